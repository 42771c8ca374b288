"""IO errors on the WAL write path break the timeline's storage, exactly like a failed fsync.

After a failed ``pwritev`` (EIO, ENOSPC, a short write that makes no progress) or a failed
segment create/rename, the file holds an unknown mix of old and new bytes. Nothing of the
failed group may be acknowledged, every later append/flush/truncate is refused until a
restart, and the restart's CRC-checked scan finds at least everything acknowledged before.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from common.pgclient import connect
from protocol.errors import RemoteProtocolError
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn
from protocol.pgwire.errors import PgError
from protocol.safekeeper import (
    AppendRequest,
    AppendResponse,
    ProposerElected,
    ProposerMessage,
    TermSwitchEntry,
    VoteRequest,
    decode_acceptor_message,
)
from safekeeper import wal_storage
from safekeeper.config import SafekeeperConfig
from safekeeper.node import SafekeeperNode
from safekeeper.receive_wal import _ByteBudget, _write_stage
from safekeeper.record_tracker import InvalidWal, RecordTracker
from safekeeper.testing import TestProposer, running_node, synthetic_wal
from safekeeper.timeline import Timeline
from safekeeper.wal_storage import WalStorage, WalStorageBroken
from tests.safekeeper.conftest import START, TENANT, TIMELINE, elected_timeline

PIECE = 65536


def append(wal: bytes, start: Lsn, k: int, piece: int = PIECE) -> AppendRequest:
    """The k-th piece of ``wal`` (which starts at ``start``); commit_lsn = its begin, so the
    control file's scan start moves and a restart finds the WAL."""
    begin = Lsn(start + k * piece)
    chunk = wal[k * piece : (k + 1) * piece]
    return AppendRequest(1, begin, Lsn(begin + len(chunk)), begin, INVALID_LSN, chunk)


async def ack(tl: Timeline, req: AppendRequest, *, pipelined: bool) -> Lsn:
    """Write, sync and acknowledge one group; returns the acknowledged flush_lsn."""
    if pipelined:
        replies, pending, error = await tl.write_appends([req])
        assert error is None and replies == [] and pending is not None
        await tl.sync(pending)
        return (await tl.finish(pending)).flush_lsn
    replies2, error = await tl.process_batch([req])
    assert error is None
    (resp,) = replies2
    assert isinstance(resp, AppendResponse)
    return resp.flush_lsn


def failing(exc: OSError) -> Callable[..., Any]:
    def fail(*args: object) -> Any:
        raise exc

    return fail


async def assert_refused_then_restart(
    tl: Timeline, directory: Path, wal: bytes, acked: Lsn, retry: AppendRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the IO working again, the timeline still refuses everything; a restart finds
    at least ``acked`` with its bytes intact."""
    monkeypatch.undo()
    assert tl.storage.broken is not None
    for pipelined in (True, False):
        with pytest.raises(WalStorageBroken) as info:
            await ack(tl, retry, pipelined=pipelined)
        assert info.value.sqlstate == "58030"
    with pytest.raises(WalStorageBroken):
        await trio.to_thread.run_sync(tl.storage.flush)
    with pytest.raises(WalStorageBroken):
        await trio.to_thread.run_sync(tl.storage.truncate, START)
    # An election's truncation goes through the same storage: refused too.
    with pytest.raises(WalStorageBroken):
        await tl.process_batch(
            [VoteRequest(2), ProposerElected(2, acked, (TermSwitchEntry(1, START), TermSwitchEntry(2, acked)))]
        )
    assert tl.acceptor.flush_lsn == acked
    assert tl.status()["wal_storage_broken"]
    tl.storage.close()

    again = Timeline.load(directory, 1, no_sync=False)
    assert again.acceptor.flush_lsn >= acked
    assert again.storage.broken is None
    got = b"".join(
        again.storage.read(Lsn(pos), acked - pos) for pos in range(START, acked, 1 << 20)
    )
    assert got == wal[: acked - START]
    again.storage.close()


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sequential"])
async def test_failed_pwritev_breaks_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, pipelined: bool
) -> None:
    directory = tmp_path / "tl"
    tl = await elected_timeline(directory)
    wal = synthetic_wal(START, 3 * PIECE, system_id=7)
    acked = await ack(tl, append(wal, START, 0), pipelined=pipelined)
    assert acked > START

    monkeypatch.setattr(os, "pwritev", failing(OSError(code, os.strerror(code))))
    with pytest.raises(WalStorageBroken) as info:
        await ack(tl, append(wal, START, 1), pipelined=pipelined)
    assert info.value.sqlstate == "58030"
    assert isinstance(tl.storage.broken, OSError) and tl.storage.broken.errno == code
    assert tl.acceptor.flush_lsn == acked
    await assert_refused_then_restart(tl, directory, wal, acked, append(wal, START, 1), monkeypatch)


async def test_a_write_that_stops_making_progress_breaks_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwritev returning 0 for a non-empty write: no errno, no progress. Retrying forever
    would hang the connection; treating it as success would ack unwritten WAL."""
    directory = tmp_path / "tl"
    tl = await elected_timeline(directory)
    wal = synthetic_wal(START, 3 * PIECE, system_id=7)
    acked = await ack(tl, append(wal, START, 0), pipelined=True)
    real = os.pwritev
    calls = [0]

    def short_then_nothing(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] == 1:
            # A partial write of the first 100 bytes really happens, then the disk is full.
            return real(fd, [memoryview(b"".join(bytes(b) for b in buffers))[:100]], offset)
        if calls[0] > 1000:
            raise AssertionError("a write that makes no progress was retried forever")
        return 0

    monkeypatch.setattr(os, "pwritev", short_then_nothing)
    with trio.fail_after(10), pytest.raises(WalStorageBroken) as info:
        await ack(tl, append(wal, START, 1), pipelined=True)
    assert isinstance(tl.storage.broken, OSError) and tl.storage.broken.errno == errno.ENOSPC
    assert "pwritev" in str(info.value)
    await assert_refused_then_restart(tl, directory, wal, acked, append(wal, START, 1), monkeypatch)


async def test_short_writes_that_progress_still_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the rule: a short write that makes progress is continued, not an
    error (the kernel may return less than asked, e.g. on a signal)."""
    tl = await elected_timeline(tmp_path / "tl")
    wal = synthetic_wal(START, 2 * PIECE, system_id=7)
    real = os.pwritev

    def at_most_1000(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, [memoryview(b"".join(bytes(b) for b in buffers))[:1000]], offset)

    monkeypatch.setattr(os, "pwritev", at_most_1000)
    acked = await ack(tl, append(wal, START, 0, 2 * PIECE), pipelined=True)
    assert acked > START and tl.storage.broken is None
    assert tl.storage.read(START, acked - START) == wal[: acked - START]


@pytest.mark.parametrize("call", ["posix_fallocate", "rename", "fsync"])
async def test_failed_segment_switch_breaks_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """A group that crosses a segment end: completing the old segment (fdatasync, rename) or
    creating the next (open, preallocate, fsync, rename, directory fsync) fails. The next
    segment's file is a spare made in the background when the first group opened the
    current one: a preallocation that fails there fails from the start (the spare's failure
    breaks nothing, the inline creation at the switch then fails and breaks the storage)."""
    start = Lsn(2 * WAL_SEGMENT_SIZE - 3 * PIECE)
    directory = tmp_path / "tl"
    tl = await elected_timeline(directory, start=start)
    wal = synthetic_wal(start, 6 * PIECE, system_id=7)
    if call == "posix_fallocate":
        monkeypatch.setattr(os, call, failing(OSError(errno.ENOSPC, "No space left on device")))
    acked = await ack(tl, append(wal, start, 0, 2 * PIECE), pipelined=True)
    assert tl.storage.broken is None
    monkeypatch.setattr(os, call, failing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(WalStorageBroken):
        await ack(tl, append(wal, start, 1, 2 * PIECE), pipelined=True)
    assert tl.acceptor.flush_lsn == acked
    monkeypatch.undo()
    with pytest.raises(WalStorageBroken):
        await ack(tl, append(wal, start, 1, 2 * PIECE), pipelined=True)
    tl.storage.close()
    again = Timeline.load(directory, 1, no_sync=False)
    assert again.acceptor.flush_lsn >= acked
    assert again.storage.read(start, acked - start) == wal[: acked - start]
    again.storage.close()


async def test_a_group_synced_before_the_break_is_not_acknowledged_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group N is written and its own fdatasync succeeds; then group N+1's write fails.
    N's bytes are durable, but nothing is acknowledged once the storage is broken (see
    ``Timeline.finish``): a restart reports them instead."""
    directory = tmp_path / "tl"
    tl = await elected_timeline(directory)
    wal = synthetic_wal(START, 3 * PIECE, system_id=7)
    _, pending, error = await tl.write_appends([append(wal, START, 0)])
    assert error is None and pending is not None
    await tl.sync(pending)  # N is durable
    monkeypatch.setattr(os, "pwritev", failing(OSError(errno.EIO, "Input/output error")))
    # N+1's write runs in the WAL IO engine: its failure is its pending flush's error.
    _, failed, error = await tl.write_appends([append(wal, START, 1)])
    assert error is None and failed is not None
    with pytest.raises(WalStorageBroken):
        await tl.sync(failed)
    with pytest.raises(WalStorageBroken):
        await tl.finish(failed)
    with pytest.raises(WalStorageBroken):
        await tl.finish(pending)
    assert tl.acceptor.flush_lsn == START
    monkeypatch.undo()
    tl.storage.close()
    again = Timeline.load(directory, 1, no_sync=False)
    # Not acknowledged, yet durable and found by the scan (the last record of N may
    # continue into N+1, so the end is N's last complete record).
    assert Lsn(START + PIECE - 8192) <= again.acceptor.flush_lsn <= START + PIECE
    n_end = again.acceptor.flush_lsn
    assert again.storage.read(START, n_end - START) == wal[: n_end - START]
    again.storage.close()


async def test_write_error_with_two_syncs_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipelined writer: group N's fdatasync is held while group N+1's pwritev fails.
    No AppendResponse leaves (not N+1's: its bytes are unknown; not N's: the storage is
    broken), no other fdatasync starts, the connection ends with WalStorageBroken (58030),
    and a restart (which fsyncs what its scan accepts) finds N."""
    directory = tmp_path / "tl"
    tl = await elected_timeline(directory)
    wal = synthetic_wal(START, 4 * PIECE, system_id=7)
    gate = threading.Event()
    started: list[int] = []
    finished: list[int] = []
    real_fdatasync = tl.storage.fdatasync

    sync_started = threading.Event()

    def held_fdatasync(fd: int) -> None:
        started.append(len(started) + 1)
        sync_started.set()
        assert gate.wait(10)
        real_fdatasync(fd)
        finished.append(len(finished) + 1)

    monkeypatch.setattr(tl.storage, "fdatasync", held_fdatasync)
    real_pwritev = os.pwritev
    writes = [0]
    write_failed = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def second_write_fails(fd: int, buffers: list[memoryview], offset: int) -> int:
        writes[0] += 1
        if writes[0] == 2:
            # The scenario is "N+1's write fails while N's fdatasync is held": N's sync task
            # reaches its fdatasync only after N's write was reported back to the event loop,
            # so without this wait a busy machine can fail N+1 first, and the nursery then
            # cancels N's sync before it starts (also safe, but not what this test checks).
            assert sync_started.wait(10)
            token.run_sync_soon(write_failed.set)
            raise OSError(errno.EIO, "Input/output error")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", second_write_fails)
    acks: list[Lsn] = []

    class Copy:
        async def send_many(self, payloads: list[bytes]) -> None:
            for payload in payloads:
                msg = decode_acceptor_message(payload, 3)
                assert isinstance(msg, AppendResponse)
                acks.append(msg.flush_lsn)

    send, receive = trio.open_memory_channel[ProposerMessage | RemoteProtocolError](100)
    for k in range(3):
        send.send_nowait(append(wal, START, k))
    outcome: list[BaseException] = []

    async def writer() -> None:
        try:
            await _write_stage(Copy(), receive, tl, 3, PIECE, _ByteBudget(1 << 30))  # type: ignore[arg-type]
        except BaseException as exc:  # the test inspects it
            outcome.append(exc)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await write_failed.wait()
            await trio.sleep(0.1)
            assert acks == [] and started == [1]
            gate.set()
    (exc,) = outcome
    leaves = list(_leaves(exc))
    # The write's error, and N's held fdatasync refused too: it reached the storage after
    # the break (a later flush is refused like any other).
    assert leaves and all(isinstance(e, WalStorageBroken) and e.sqlstate == "58030" for e in leaves)
    assert acks == []
    assert started == [1] and finished == []
    monkeypatch.undo()
    tl.storage.close()
    again = Timeline.load(directory, 1, no_sync=False)
    assert again.acceptor.flush_lsn >= START + PIECE - 8192
    n_end = again.acceptor.flush_lsn
    assert n_end <= START + PIECE
    assert again.storage.read(START, n_end - START) == wal[: n_end - START]
    again.storage.close()


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


@pytest.fixture
async def synced_node(tmp_path: Path) -> AsyncIterator[SafekeeperNode]:
    async with running_node(tmp_path / "sk", no_sync=False) as sk:
        yield sk


@pytest.fixture
async def buffered_synced_node(tmp_path: Path) -> AsyncIterator[SafekeeperNode]:
    """Durable and buffered: its groups' fdatasyncs run in sync workers beside the next
    write (with O_DIRECT, the default, a group is synced by its own write call)."""
    async with running_node(tmp_path / "sk", no_sync=False, wal_direct_io=False) as sk:
        assert not sk.cfg.direct_io
        yield sk


async def test_node_ends_the_push_with_58030_and_refuses_until_restart(
    synced_node: SafekeeperNode, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    node = synced_node
    assert node.pg_port is not None
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 4 * PIECE)
    with trio.fail_after(30):
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal[:PIECE]])
            # The piece ends inside a record: the ack is that record's start. Wait for it (the
            # piece may arrive as two groups, and a later ack of its second one is no failure).
            last_record_end = Lsn(RecordTracker(start).feed(wal[:PIECE]))
            acked = (await p.wait_flush(last_record_end)).flush_lsn
            assert acked == last_record_end
            eio = failing(OSError(errno.EIO, "Input/output error"))
            monkeypatch.setattr(os, "pwritev", eio)
            # The node writes with O_DIRECT (its default): the write kernel does the pwrite.
            monkeypatch.setattr(wal_storage, "write_staged", eio)
            await p.append_many(end, [wal[PIECE : 2 * PIECE]])
            with pytest.raises(PgError) as info:
                while True:
                    msg = await p.receive()
                    assert not (isinstance(msg, AppendResponse) and msg.flush_lsn > acked)
            assert info.value.sqlstate == "58030"
            assert info.value.severity == "FATAL"
        monkeypatch.undo()
        # A new proposer, with the disk working again: still refused.
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE) as q:
            await q.greet()
            with pytest.raises(PgError) as info:
                begin = await q.elect(start)
                await q.append_many(begin, [wal[begin - start : begin - start + PIECE]])
                while True:
                    msg = await q.receive()
                    assert not (isinstance(msg, AppendResponse) and msg.flush_lsn > acked)
            assert info.value.sqlstate == "58030"
        # The node itself goes on serving: status and replication of acknowledged WAL.
        conn = await connect(
            "127.0.0.1", node.pg_port, user="postgres", params={"replication": "true"},
            options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
        )
        async with conn:
            (row,) = await conn.query("TIMELINE_STATUS")
            assert row[0] is not None
    node.stop()
    await trio.sleep(0.1)
    # Restart: a fresh node on the same directory finds at least what was acknowledged.
    again = SafekeeperNode(
        SafekeeperConfig(
            data_dir=str(tmp_path / "sk"), listen_pg="127.0.0.1:0", listen_http="127.0.0.1:0",
            no_sync=False,
        )
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(again.run)
        tl = await again.get_timeline(TENANT, TIMELINE, False)
        assert tl is not None and tl.acceptor.flush_lsn >= acked
        assert tl.storage.read(start, acked - start) == wal[: acked - start]
        again.stop()


_TORN_WAL = {
    size: synthetic_wal(START, 48 * 1024, record_size=size, system_id=7) for size in (200, 3000, 8000)
}


@settings(max_examples=150, deadline=None)
@given(
    record_size=st.sampled_from(sorted(_TORN_WAL)),
    cut=st.integers(min_value=1, max_value=48 * 1024 - 1),
    tail=st.sampled_from([0, 1, 8192, 1 << 20]),
)
def test_scan_end_is_the_last_complete_record_before_a_torn_one(
    record_size: int, cut: int, tail: int
) -> None:
    """What a restart scan reads after a crash: complete records, then one torn record (its
    first bytes written, the rest of the preallocated file zeros), all in one read chunk.
    The end of WAL it reports must be exactly what a tracker fed only the written prefix
    reports: the end of the last complete record, not the start of the chunk."""
    wal = _TORN_WAL[record_size]
    prefix = RecordTracker(START, WAL_SEGMENT_SIZE)
    prefix.feed(wal[:cut])
    scan = RecordTracker(START, WAL_SEGMENT_SIZE)
    try:
        scan.feed(wal[:cut] + bytes(tail))
    except InvalidWal:
        pass
    assert scan.record_end == prefix.record_end


async def test_node_write_error_with_a_sync_in_flight_still_ends_with_58030(
    buffered_synced_node: SafekeeperNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group A's fdatasync is held (before the storage's own check) while group B's write
    fails: the writer and A's then refused sync both raise. The connection must still end
    with FATAL 58030 (not the server's generic answer to an exception group), and neither A
    nor B is acknowledged."""
    node = buffered_synced_node
    assert node.pg_port is not None
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, PIECE + (2 << 20))
    gate = threading.Event()
    holding = threading.Event()
    hold = [False]
    real_fdatasync = WalStorage.fdatasync

    def held(self: WalStorage, fd: int) -> None:
        if hold[0]:
            hold[0] = False
            holding.set()
            assert gate.wait(10)
        real_fdatasync(self, fd)

    real_pwritev = os.pwritev
    writes = [0]

    def second_write_fails(fd: int, buffers: list[memoryview], offset: int) -> int:
        writes[0] += 1
        if writes[0] == 2:
            # Only once A's fdatasync is held: were B's failure first, A's sync task could
            # be cancelled before it starts and nothing would be in flight.
            assert holding.wait(10)
            raise OSError(errno.EIO, "Input/output error")
        return real_pwritev(fd, buffers, offset)

    with trio.fail_after(30):
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal[:PIECE]])
            # Every group of the first piece acknowledged (the piece may have arrived as two
            # groups): no fdatasync of it is still due once the hold is armed, so the held one
            # is A's.
            last_record_end = Lsn(RecordTracker(start).feed(wal[:PIECE]))
            acked = (await p.wait_flush(last_record_end)).flush_lsn
            assert acked == last_record_end
            monkeypatch.setattr(WalStorage, "fdatasync", held)
            monkeypatch.setattr(os, "pwritev", second_write_fails)
            hold[0] = True
            # Two 1 MiB groups in one send: A is written and its sync held, B's write fails.
            rest = wal[PIECE:]
            await p.append_many(end, [rest[k : k + PIECE] for k in range(0, len(rest), PIECE)])
            while writes[0] < 2:
                await trio.sleep(0.01)
            await trio.sleep(0.2)
            gate.set()
            with pytest.raises(PgError) as info:
                while True:
                    msg = await p.receive()
                    assert not (isinstance(msg, AppendResponse) and msg.flush_lsn > acked)
            assert info.value.sqlstate == "58030"
            assert info.value.severity == "FATAL"


@pytest.mark.parametrize("pipelined", [True, False])
async def test_a_new_segments_name_is_synced_off_the_write_path_before_its_ack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipelined: bool
) -> None:
    """The write that crosses into a new segment renames a spare into place and does not
    fsync the directory itself; the group's sync does (pipelined: in its sync worker, beside
    its fdatasync; sequential: in ``flush``), before the group is acknowledged. A failure of
    that directory fsync breaks the storage like a failed fdatasync: no ack."""
    start = Lsn(2 * WAL_SEGMENT_SIZE - 3 * PIECE)
    directory = tmp_path / "tl"
    tl = await elected_timeline(directory, start=start)
    wal = synthetic_wal(start, 6 * PIECE, system_id=7)
    acked = await ack(tl, append(wal, start, 0, 2 * PIECE), pipelined=pipelined)
    await tl.io.run(tl.storage.join_spare)  # the spare is ready before the switch
    import common.fsync
    import safekeeper.wal_storage as ws

    events: list[str] = []
    real_fsync_dir, real_write_group = common.fsync.fsync_dir, WalStorage.write_group

    def fsync_dir(path: Path) -> None:
        events.append("dir fsync")
        real_fsync_dir(path)

    def write_group(self: WalStorage, begin: Lsn, chunks: Any) -> Any:
        events.append("write begins")
        try:
            return real_write_group(self, begin, chunks)
        finally:
            events.append("write ends")

    monkeypatch.setattr(ws, "fsync_dir", fsync_dir)
    monkeypatch.setattr(WalStorage, "write_group", write_group)
    acked2 = await ack(tl, append(wal, start, 1, 2 * PIECE), pipelined=pipelined)
    assert acked2 > 2 * WAL_SEGMENT_SIZE > acked  # the group's WAL in the new segment is acked
    assert tl.storage.spares_used == 1
    assert events == ["write begins", "write ends", "dir fsync"]
    # The next group in the same segment needs no directory fsync.
    events.clear()
    await ack(tl, append(wal, start, 2, 2 * PIECE), pipelined=pipelined)
    assert events == ["write begins", "write ends"]
    tl.storage.close()

    # The same switch with the directory fsync failing: broken, nothing acknowledged.
    directory = tmp_path / "tl2"
    tl = await elected_timeline(directory, start=start)
    monkeypatch.undo()
    acked = await ack(tl, append(wal, start, 0, 2 * PIECE), pipelined=pipelined)
    await tl.io.run(tl.storage.join_spare)
    monkeypatch.setattr(ws, "fsync_dir", failing(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(WalStorageBroken):
        await ack(tl, append(wal, start, 1, 2 * PIECE), pipelined=pipelined)
    assert tl.acceptor.flush_lsn == acked
    assert tl.storage.broken is not None
    tl.storage.close()
