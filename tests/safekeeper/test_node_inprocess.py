"""The safekeeper node in-process: push WAL with the test proposer, read it back."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from common.pgclient import connect
from protocol import _native
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.pgwire.errors import PgError
from protocol.replication import (
    NeonFeedback,
    XLogData,
    decode_server_copy_data,
    encode_copy_message,
)
from protocol.safekeeper import AppendResponse, PageserverFeedback, ProposerGreeting
from safekeeper.config import SafekeeperConfig
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, running_node, synthetic_wal

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[SafekeeperNode]:
    async with running_node(tmp_path / "sk") as sk:
        yield sk


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
            for lsn, error in [(Lsn(end + 8), "ahead of the WAL flush"), (Lsn(8), "removed")]:
                with pytest.raises(PgError, match=error):
                    await conn.copy_both(f"START_REPLICATION {format_lsn(lsn)} TIMELINE 1")
            (row,) = await conn.query("TIMELINE_STATUS")
            assert row == (format_lsn(end), format_lsn(end))
            assert await conn.query("SHOW wal_segment_size") == [("16MB",)]


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


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    def get() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    return await trio.to_thread.run_sync(get)


@pytest.mark.parametrize(
    ("max_write_bytes", "no_sync"),
    # fsync on + coalescing is the pipelined writer (group N+1 written during N's fdatasync).
    [(0, True), (1 << 20, True), (1 << 20, False)],
)
async def test_coalescing_one_response_per_group(
    tmp_path: Path, max_write_bytes: int, no_sync: bool
) -> None:
    cfg = SafekeeperConfig(
        data_dir=str(tmp_path / "sk"), listen_pg="127.0.0.1:0", listen_http="127.0.0.1:0",
        no_sync=no_sync, max_write_bytes=max_write_bytes,
    )
    sk = SafekeeperNode(cfg)
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 2 << 20, record_size=1000)
    chunks = [wal[i : i + 1024] for i in range(0, len(wal), 1024)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(sk.run)
            async with await proposer(sk) as p:
                await p.greet()
                await p.elect(start)
                end = await p.append_many(start, chunks)
                responses = 0
                last_flush = start
                while True:
                    reply = await p.receive()
                    assert isinstance(reply, AppendResponse)
                    assert reply.flush_lsn >= last_flush
                    last_flush = reply.flush_lsn
                    responses += 1
                    if reply.flush_lsn == end:
                        break
            assert sk.http_port is not None
            code, body = await http_get(sk.http_port, f"/v1/tenant/{TENANT}/timeline/{TIMELINE}")
            assert code == 200
            status = json.loads(body)
            assert status["flush_lsn"] == format_lsn(end)
            assert status["write_messages"] == len(chunks) + 3  # + greeting, vote, elected
            if not no_sync:
                assert status["fsyncs"] >= status["write_groups"]
            if max_write_bytes == 0:
                assert status["write_groups"] == len(chunks)
                assert responses == len(chunks)
            else:
                # All 2048 messages were sent at once: groups hold whatever arrived while the
                # previous group was written (at least one socket read, >= 64 KiB).
                assert status["write_groups"] <= len(chunks) // 16
                assert responses == status["write_groups"]
            code, metrics = await http_get(sk.http_port, "/metrics")
            assert code == 200
            assert b"safekeeper_write_group_messages_bucket" in metrics
            assert b"safekeeper_flush_lsn{" in metrics
            code, body = await http_get(sk.http_port, f"/v1/tenant/{'0' * 32}/timeline/{TIMELINE}")
            assert code == 404 and b"not found" in body
            # /v1/status says which kernels run (native or the pure-Python twins)
            code, body = await http_get(sk.http_port, "/v1/status")
            assert code == 200 and json.loads(body)["impl"] == _native.IMPL
            sk.stop()


async def test_greeting_checks_and_no_creation(node: SafekeeperNode) -> None:
    with trio.fail_after(30):
        # The greeting must name the connection's timeline.
        async with await proposer(node) as p:
            p.timeline_id = TimelineId(bytes(16))
            await p.send(
                ProposerGreeting(TENANT, TimelineId(bytes(16)), 150000, 1, WAL_SEGMENT_SIZE)
            )
            with pytest.raises(PgError, match="on a connection for"):
                await p.receive()
        # allow_timeline_creation=false on an unknown timeline: the stream just ends.
        async with await proposer(node, allow_timeline_creation=False) as p:
            await p.send(ProposerGreeting(TENANT, TIMELINE, 150000, 1, WAL_SEGMENT_SIZE))
            assert await p.copy.receive() is None
        assert node.timelines == {}


async def test_pageserver_feedback_reaches_the_proposer(node: SafekeeperNode) -> None:
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 32 * 1024)
    feedback = PageserverFeedback(
        current_timeline_size=123,
        last_received_lsn=Lsn(start + 100),
        disk_consistent_lsn=Lsn(start + 50),
        remote_consistent_lsn=Lsn(start + 10),
        replytime=42,
    )
    with trio.fail_after(30):
        async with await proposer(node) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal])
            await commit_everything(p, end)
            conn = await connect(
                "127.0.0.1", node.pg_port or 0, user="postgres",
                params={"replication": "true", "application_name": "pageserver-1"},
                options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
            )
            async with conn:
                copy = await conn.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
                await copy.send(encode_copy_message(NeonFeedback(feedback)))
                with trio.fail_after(20):
                    while not node.timelines[(TENANT, TIMELINE)].ps_feedback:
                        await trio.sleep(0.01)
                more = synthetic_wal(end, 8192)
                end2 = await p.append_many(end, [more])
                resp = await p.wait_flush(end2)
                assert resp.pageserver_feedback == feedback
                status = node.timelines[(TENANT, TIMELINE)].status()
                replicas = status["replicas"]
                assert isinstance(replicas, list)
                assert replicas[0]["flush_lsn"] == format_lsn(start + 50)


async def commit_everything(p: TestProposer, end: Lsn) -> None:
    await p.append(end, b"", commit_lsn=end)
    resp = await p.wait_flush(end)
    while resp.commit_lsn < end:
        resp = await p.wait_flush(end)
