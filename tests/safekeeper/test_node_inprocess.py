"""The safekeeper node in-process: push WAL with the test proposer, read it back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from common.pgclient import connect
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.pgwire.errors import PgError
from protocol.replication import XLogData, decode_server_copy_data
from protocol.safekeeper import AppendResponse
from safekeeper.config import SafekeeperConfig
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, synthetic_wal

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[SafekeeperNode]:
    cfg = SafekeeperConfig(
        data_dir=str(tmp_path / "sk"),
        listen_pg="127.0.0.1:0",
        listen_http="127.0.0.1:0",
        no_sync=True,
    )
    sk = SafekeeperNode(cfg)
    async with trio.open_nursery() as nursery:
        await nursery.start(sk.run)
        yield sk
        sk.stop()


async def proposer(sk: SafekeeperNode, **kw: object) -> TestProposer:
    assert sk.pg_port is not None
    return await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [2, 3])
async def test_push_and_stream_back(node: SafekeeperNode, version: int) -> None:
    start = Lsn(WAL_SEGMENT_SIZE + 0x28)
    wal = synthetic_wal(start, 3 * 1024 * 1024, record_size=300)
    with trio.fail_after(30):
        async with await proposer(node, version=version) as p:
            await p.greet(system_id=77)
            begin = await p.elect(start)
            assert begin == start
            chunks = [wal[i : i + 8192] for i in range(0, len(wal), 8192)]
            end = await p.append_many(start, chunks)
            resp = await p.wait_flush(end)
            assert resp.flush_lsn == end
            # commit = previous chunk's end; a final heartbeat commits everything.
            await p.append(end, b"", commit_lsn=end)
            resp = await p.wait_flush(end)
            while resp.commit_lsn < end:
                resp = await p.wait_flush(end)
            assert isinstance(resp, AppendResponse)

        conn = await connect(
            "127.0.0.1", node.pg_port or 0, user="postgres", params={"replication": "true"},
            options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
        )
        async with conn:
            (row,) = await conn.query("IDENTIFY_SYSTEM")
            assert row == ("77", "1", format_lsn(end), None)
            copy = await conn.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
            got = bytearray()
            while len(got) < end - start:
                payload = await copy.receive()
                assert payload is not None
                msg = decode_server_copy_data(payload)
                if isinstance(msg, XLogData):
                    assert msg.wal_start == start + len(got)
                    got += msg.data
            assert bytes(got) == wal[: end - start]
            await conn.finish_copy()


async def test_hostile_bytes_end_only_that_connection(node: SafekeeperNode) -> None:
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 64 * 1024)
    with trio.fail_after(30):
        async with await proposer(node) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal])
            await p.wait_flush(end)
            # Garbage: an unknown tag.
            async with await proposer(node) as bad:
                await bad.copy.send(b"\xff garbage")
                with pytest.raises(PgError):
                    await bad.receive()
            # A gap.
            async with await proposer(node) as bad:
                await bad.greet()
                bad.term = p.term
                await bad.append(Lsn(end + 8192), b"x" * 16)
                with pytest.raises(PgError, match="gap"):
                    await bad.receive()
            # A term above the elected one.
            async with await proposer(node) as bad:
                await bad.greet()
                bad.term = p.term + 5
                await bad.append(end, b"x" * 16)
                with pytest.raises(PgError, match="before ProposerElected"):
                    await bad.receive()
            # The first connection is unharmed.
            more = synthetic_wal(end, 8192)
            end2 = await p.append_many(end, [more])
            resp = await p.wait_flush(end2)
            assert resp.flush_lsn == end2
