"""WAL removal: the horizon rule (property test) and a node removing segments a pageserver-like
consumer has acknowledged, with 58P01 for a stream from a removed segment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from common.pgclient import PgClientConnection, connect
from common.pgcopy import CopyBothStream
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.pgwire.errors import PgError
from protocol.replication import (
    StandbyStatusUpdate,
    XLogData,
    decode_server_copy_data,
    encode_copy_message,
)
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, running_node, synthetic_wal
from safekeeper.timeline import Timeline
from safekeeper.wal_removal import removal_horizon, segments_to_remove
from safekeeper.wal_storage import WalStorage, WalStorageError
from tests.safekeeper.test_node_inprocess import TENANT, TIMELINE, commit_everything

SEG = WAL_SEGMENT_SIZE

lsns = st.integers(min_value=0, max_value=64 * SEG).map(Lsn)


@given(
    remote=lsns,
    peer=lsns,
    commit=lsns,
    flush=lsns,
    consumers=st.lists(lsns, max_size=4),
    existing=st.sets(st.integers(min_value=0, max_value=70)),
    seg_size=st.sampled_from([SEG, 1 << 20, 8192]),
)
def test_removal_never_touches_a_segment_with_bytes_at_or_above_the_horizon(
    remote: Lsn,
    peer: Lsn,
    commit: Lsn,
    flush: Lsn,
    consumers: list[Lsn],
    existing: set[int],
    seg_size: int,
) -> None:
    horizon = removal_horizon(
        remote_consistent_lsn=remote,
        peer_horizon_lsn=peer,
        commit_lsn=commit,
        flush_lsn=flush,
        consumers=consumers,
    )
    for bound in (remote, peer, commit, flush, *consumers):
        assert horizon <= bound
    assert horizon in (remote, peer, commit, flush, *consumers)
    removed = segments_to_remove(existing, horizon, seg_size)
    assert set(removed) <= existing
    for segno in removed:
        # The segment's last byte is below the horizon, so every byte is.
        assert (segno + 1) * seg_size - 1 < horizon
    # And nothing removable is kept.
    for segno in existing - set(removed):
        assert (segno + 1) * seg_size > horizon


def test_storage_refuses_to_remove_at_or_above_the_flushed_end(tmp_path: Path) -> None:
    start = Lsn(SEG)
    wal = synthetic_wal(start, SEG + SEG // 2, record_size=8000)
    storage = WalStorage(tmp_path, no_sync=True)
    storage.truncate(start)
    storage.write(start, [wal])
    storage.flush()
    assert storage.segments() == [1, 2]
    with pytest.raises(WalStorageError, match="refusing"):
        storage.remove_segments_below(3)
    assert storage.remove_segments_below(2) == [1]
    assert storage.segments() == [2]
    assert storage.remove_segments_below(2) == []


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[SafekeeperNode]:
    async with running_node(tmp_path / "sk", wal_removal_period_s=0.05) as sk:
        yield sk


async def replication(sk: SafekeeperNode, name: str) -> PgClientConnection:
    return await connect(
        "127.0.0.1", sk.pg_port or 0, user="postgres",
        params={"replication": "true", "application_name": name},
        options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
    )


async def read_stream(copy: CopyBothStream, start: Lsn, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        payload = await copy.receive()
        assert payload is not None
        msg = decode_server_copy_data(payload)
        if isinstance(msg, XLogData):
            assert msg.wal_start == start + len(got)
            got += msg.data
    return bytes(got[:size])


def segment_files(sk: SafekeeperNode) -> list[int]:
    return WalStorage(sk.timeline_dir(TENANT, TIMELINE)).segments()


async def settle() -> None:
    # Several removal periods.
    await trio.sleep(0.3)


async def test_acknowledged_segments_are_removed_and_old_starts_fail(node: SafekeeperNode) -> None:
    start = Lsn(SEG)
    wal = synthetic_wal(start, 2 * SEG + 6 * SEG // 10, record_size=8000)
    # A record end in segment 2, late enough that committing the rest does not make the lazy
    # control-file save happen again: removal itself must save commit_lsn before it deletes.
    first_commit = Lsn(start + len(synthetic_wal(start, 19 * SEG // 10, record_size=8000)))
    assert wal.startswith(wal[: first_commit - start]) and first_commit // SEG == 2
    chunk = 128 * 1024
    chunks = [wal[i : i + chunk] for i in range(0, len(wal), chunk)]
    # X: a chunk boundary in the last segment (segment number 3).
    x = Lsn(start + (2 * SEG + 3 * SEG // 10) // chunk * chunk)
    assert x // SEG == 3
    with trio.fail_after(60):
        async with await TestProposer.connect("127.0.0.1", node.pg_port or 0, TENANT, TIMELINE) as p:
            await p.greet()
            await p.elect(start)
            # Every safekeeper has everything up to X (the proposer's truncate_lsn).
            p.truncate_lsn = x
            # commit_lsn only at the end: a real proposer's commit_lsn is a record end (the
            # restart scan starts there), and chunk boundaries are not.
            end = await p.append_many(start, chunks, commit=False)
            assert end // SEG == 3
            await p.append(end, b"", commit_lsn=first_commit)
            while (await p.wait_flush(end)).commit_lsn < first_commit:
                pass
            await commit_everything(p, end)
            tl = node.timelines[(TENANT, TIMELINE)]
            assert tl.persisted.commit_lsn == first_commit
            assert segment_files(node) == [1, 2, 3]

            # Nothing is removed before a pageserver reports (remote_consistent_lsn is the start).
            await settle()
            assert segment_files(node) == [1, 2, 3]

            standby = await replication(node, "standby")
            ps = await replication(node, "pageserver-1")
            async with standby, ps:
                # A live standby that started at the beginning holds the WAL it may still need.
                standby_copy = await standby.copy_both(f"START_REPLICATION {format_lsn(start)}")
                ps_copy = await ps.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
                assert await read_stream(ps_copy, start, x - start) == wal[: x - start]
                await ps_copy.send(
                    encode_copy_message(StandbyStatusUpdate(x, x, x, 0, False))
                )
                with trio.fail_after(30):
                    while tl.acceptor.remote_consistent_lsn != x:
                        await trio.sleep(0.01)
                await settle()
                assert segment_files(node) == [1, 2, 3]
                assert tl.removal_horizon() == start

                # The standby reports it has flushed up to X: now segments 1 and 2 can go.
                await standby_copy.send(
                    encode_copy_message(StandbyStatusUpdate(x, x, Lsn(0), 0, False))
                )
                with trio.fail_after(30):
                    while segment_files(node) != [3]:
                        await trio.sleep(0.02)
                assert tl.removal_horizon() == x
                assert tl.status()["wal_removed_below"] == format_lsn(3 * SEG)
                # Both live streams continue from where they were.
                more = await read_stream(ps_copy, x, end - x)
                assert more == wal[x - start : end - start]

            # A stream from a removed segment: PostgreSQL's 58P01, never a silent gap.
            conn = await replication(node, "late-standby")
            async with conn:
                for old in (start, Lsn(3 * SEG - 8)):
                    with pytest.raises(PgError, match="has already been removed") as err:
                        await conn.copy_both(f"START_REPLICATION {format_lsn(old)}")
                    assert err.value.sqlstate == "58P01"
                copy = await conn.copy_both(f"START_REPLICATION {format_lsn(x)}")
                assert await read_stream(copy, x, end - x) == wal[x - start : end - start]

            # The control file lets a restart find the end of WAL without the removed segments.
            assert tl.persisted.commit_lsn == end
            reloaded = Timeline.load(tl.directory, 1, no_sync=True)
            assert reloaded.acceptor.flush_lsn == end
            assert reloaded.acceptor.remote_consistent_lsn <= x
            reloaded.storage.close()

            # WAL keeps flowing after removal.
            more_wal = synthetic_wal(end, 64 * 1024, record_size=8000)
            end2 = await p.append_many(end, [more_wal])
            resp = await p.wait_flush(end2)
            assert resp.flush_lsn == end2
