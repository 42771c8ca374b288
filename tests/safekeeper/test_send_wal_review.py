"""Replication out under elections and removal: reviewed edge cases of ``send_wal``.

A ``(term='N')`` stream must end (with an error the receiver sees) when the term moves on,
and must never carry bytes read after the new term truncated WAL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from common.pgclient import PgClientConnection, connect
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.pgwire.errors import PgError
from protocol.replication import (
    PrimaryKeepalive,
    StandbyStatusUpdate,
    XLogData,
    decode_server_copy_data,
    encode_copy_message,
    pg_now,
)
from protocol.safekeeper import ProposerElected, TermSwitchEntry
from safekeeper import send_wal
from safekeeper.node import SafekeeperNode
from safekeeper.testing import SafekeeperProcess, TestProposer, running_node, synthetic_wal

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[SafekeeperNode]:
    async with running_node(tmp_path / "sk", wal_removal_period_s=0) as sk:
        yield sk


async def proposer(sk: SafekeeperNode) -> TestProposer:
    assert sk.pg_port is not None
    return await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE)


async def replication(sk: SafekeeperNode, name: str = "walreceiver") -> PgClientConnection:
    return await connect(
        "127.0.0.1", sk.pg_port or 0, user="postgres",
        params={"replication": "true", "application_name": name},
        options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
    )


async def test_term_stream_ends_with_an_error_when_the_term_changes(node: SafekeeperNode) -> None:
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 64 * 1024)
    with trio.fail_after(30):
        async with await proposer(node) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal], commit=False)
            await p.wait_flush(end)
            term = p.term
        conn = await replication(node, "safekeeper-2")
        async with conn:
            copy = await conn.copy_both(
                f"START_REPLICATION PHYSICAL {format_lsn(start)} (term='{term}')"
            )
            got = 0
            while got < end - start:
                payload = await copy.receive()
                assert payload is not None
                msg = decode_server_copy_data(payload)
                if isinstance(msg, XLogData):
                    got += len(msg.data)
            # A new proposer wins the next term: the recovery stream of term N must end.
            async with await proposer(node) as p2:
                await p2.greet()
                await p2.elect(start)
                with trio.fail_after(10), pytest.raises(PgError, match="term"):
                    while True:
                        if await copy.receive() is None:
                            break
        # A stream asked for a term that is not the current one is refused outright.
        conn = await replication(node, "safekeeper-2")
        async with conn:
            with trio.fail_after(10), pytest.raises(PgError, match="term"):
                copy = await conn.copy_both(
                    f"START_REPLICATION PHYSICAL {format_lsn(start)} (term='{term}')"
                )
                while await copy.receive() is not None:
                    pass


async def test_term_stream_never_sends_bytes_read_across_a_truncation(
    node: SafekeeperNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender checked the term, then its read ran while a higher term truncated the WAL
    (both are worker threads): what it read is zeros, not term N's WAL, and must not be sent."""
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 64 * 1024)
    with trio.fail_after(30):
        async with await proposer(node) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal], commit=False)
            await p.wait_flush(end)
            term = p.term
        tl = node.timelines[(TENANT, TIMELINE)]
        reading = trio.Event()
        truncated = trio.Event()
        original = tl.read_wal

        async def read_during_election(lsn: Lsn, size: int) -> bytes:
            if not reading.is_set():
                reading.set()
                await truncated.wait()
            return await original(lsn, size)

        monkeypatch.setattr(tl, "read_wal", read_during_election)
        conn = await replication(node, "safekeeper-2")
        async with conn:
            copy = await conn.copy_both(
                f"START_REPLICATION PHYSICAL {format_lsn(start)} (term='{term}')"
            )
            await reading.wait()
            # Term 2 was elected on a history where term 1 had no WAL: truncate at start.
            async with await proposer(node) as p2:
                await p2.greet()
                vote = await p2.vote(term + 1)
                assert vote.vote_given
                await p2.send(
                    ProposerElected(
                        term + 1,
                        start,
                        (TermSwitchEntry(term, start), TermSwitchEntry(term + 1, start)),
                    )
                )
                await tl.term.wait_value(lambda t: t == term + 1)
            assert tl.acceptor.flush_lsn == start
            truncated.set()
            with pytest.raises(PgError, match="term"):
                while True:
                    payload = await copy.receive()
                    assert payload is not None
                    msg = decode_server_copy_data(payload)
                    if isinstance(msg, XLogData):
                        off = msg.wal_start - start
                        assert bytes(msg.data) == wal[off : off + len(msg.data)]


async def test_receiver_ahead_of_the_restarted_commit_lsn_waits_instead_of_failing(
    tmp_path: Path,
) -> None:
    """commit_lsn is persisted lazily, so a kill -9 restarts it lower than what a receiver
    (a standby, the pageserver) already got. Its reconnection at its own position must be
    served (keepalives, then WAL as commit_lsn passes it), not refused as "ahead"; a start
    beyond the flushed WAL is still refused."""
    sk = SafekeeperProcess(tmp_path / "sk", no_sync=True, wal_removal_period_s=0)
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 64 * 1024)
    sk.start()
    try:
        with trio.fail_after(60):
            async with await TestProposer.connect(
                "127.0.0.1", sk.pg_port, TENANT, TIMELINE
            ) as p:
                await p.greet()
                await p.elect(start)
                end = await p.append_many(start, [wal[:32768], wal[32768:]])
                await p.append(end, b"", commit_lsn=end)
                resp = await p.wait_flush(end)
                while resp.commit_lsn < end:
                    resp = await p.wait_flush(end)
            status = sk.timeline_status(TENANT, TIMELINE)
            assert status["commit_lsn"] == format_lsn(end)
            assert status["persisted_commit_lsn"] != format_lsn(end)
            await trio.to_thread.run_sync(sk.kill)
            await trio.to_thread.run_sync(sk.start)
            status = sk.timeline_status(TENANT, TIMELINE)
            assert status["flush_lsn"] == format_lsn(end)
            assert status["commit_lsn"] != format_lsn(end)
            conn = await connect(
                "127.0.0.1", sk.pg_port, user="postgres",
                params={"replication": "true", "application_name": "walreceiver"},
                options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
            )
            async with conn:
                with pytest.raises(PgError, match="ahead of the WAL flush"):
                    await conn.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(Lsn(end + 8))}")
                copy = await conn.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(end)}")
                payload = await copy.receive()
                assert payload is not None
                msg = decode_server_copy_data(payload)
                assert isinstance(msg, PrimaryKeepalive) and msg.reply_requested
                await conn.finish_copy()
    finally:
        await trio.to_thread.run_sync(sk.kill)


async def test_a_silent_receiver_is_dropped_and_releases_the_removal_horizon(
    node: SafekeeperNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that never replies (its host died, a half-open connection) is dropped after
    the replication timeout, so its start stops pinning WAL removal; one that answers the
    keepalives stays."""
    monkeypatch.setattr(send_wal, "RECEIVER_TIMEOUT_S", 2.0, raising=False)
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 16 * 1024)
    with trio.fail_after(30):
        async with await proposer(node) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal])
            await p.append(end, b"", commit_lsn=end)
            await p.wait_flush(end)
        tl = node.timelines[(TENANT, TIMELINE)]
        silent = await replication(node, "silent")
        polite = await replication(node, "polite")
        async with silent, polite:
            s_copy = await silent.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
            p_copy = await polite.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
            while sorted(r.name for r in tl.replicas.values()) != ["polite", "silent"]:
                await trio.sleep(0.01)

            async def answer_keepalives() -> None:
                while True:
                    payload = await p_copy.receive()
                    assert payload is not None
                    msg = decode_server_copy_data(payload)
                    if isinstance(msg, PrimaryKeepalive) and msg.reply_requested:
                        await p_copy.send(
                            encode_copy_message(StandbyStatusUpdate(start, start, start, pg_now(), False))
                        )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_keepalives)
                with trio.fail_after(10), pytest.raises(PgError, match="replication timeout"):
                    while await s_copy.receive() is not None:
                        pass
                assert [r.name for r in tl.replicas.values()] == ["polite"]
                await trio.sleep(1.0)
                assert [r.name for r in tl.replicas.values()] == ["polite"]
                nursery.cancel_scope.cancel()


async def test_while_wal_flows_the_sender_asks_for_replies_before_the_timeout(
    node: SafekeeperNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No idle keepalive goes out while WAL keeps coming; a receiver that replies only when
    asked (a standby with wal_receiver_status_interval = 0) must still be asked in time."""
    monkeypatch.setattr(send_wal, "RECEIVER_TIMEOUT_S", 2.0, raising=False)
    monkeypatch.setattr(send_wal, "KEEPALIVE_INTERVAL_S", 100.0)
    start = Lsn(WAL_SEGMENT_SIZE)
    with trio.fail_after(30):
        async with await proposer(node) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [synthetic_wal(start, 8192)])
            await p.append(end, b"", commit_lsn=end)
            await p.wait_flush(end)
            conn = await replication(node, "asked-only")
            async with conn:
                copy = await conn.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
                asked = 0

                async def reply_when_asked() -> None:
                    nonlocal asked
                    while True:
                        payload = await copy.receive()
                        assert payload is not None
                        msg = decode_server_copy_data(payload)
                        if isinstance(msg, PrimaryKeepalive) and msg.reply_requested:
                            asked += 1
                            await copy.send(
                                encode_copy_message(StandbyStatusUpdate(start, start, start, pg_now(), False))
                            )

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reply_when_asked)
                    # 4.2 s of WAL trickling in, one page every 0.3 s.
                    for _ in range(14):
                        await trio.sleep(0.3)
                        # Whole records: flush_lsn (record-aligned) reaches the chunk's end.
                        chunk = synthetic_wal(end, 4096)
                        await p.append(end, chunk, commit_lsn=end)
                        end = Lsn(end + len(chunk))
                        await p.wait_flush(end)
                    await p.append(end, b"", commit_lsn=end)
                    await p.wait_flush(end)
                    await trio.sleep(0.3)
                    tl = node.timelines[(TENANT, TIMELINE)]
                    assert [r.name for r in tl.replicas.values()] == ["asked-only"]
                    assert asked >= 2
                    nursery.cancel_scope.cancel()
