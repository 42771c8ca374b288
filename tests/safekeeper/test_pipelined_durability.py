"""The pipelined writer never acknowledges WAL that no fdatasync has covered, even when the
group that wrote it ended in a proposer error."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

import common.fsync
import safekeeper.control_file
import safekeeper.timeline
from protocol.lsn import INVALID_LSN, Lsn
from protocol.safekeeper import AppendRequest
from safekeeper.acceptor import AcceptorError
from safekeeper.receive_wal import SYNCS_IN_FLIGHT, _ByteBudget, _write_stage
from safekeeper.record_tracker import InvalidWal, RecordTracker
from safekeeper.testing import synthetic_wal
from safekeeper.timeline import Timeline
from safekeeper.wal_storage import TrackedGroup, WalStorage, WalStorageBroken, WalStorageError
from tests.safekeeper.conftest import (
    START,
    SYSTEM_ID,
    TENANT,
    TIMELINE,
    AckRecorder,
    elected_timeline,
    queued_appends,
    wait_until,
)


async def _elected_timeline(tmp_path: Path) -> Timeline:
    """A timeline with fsync on, greeted and elected in term 1 at ``START``."""
    return await elected_timeline(tmp_path / "tl", no_sync=False)


async def test_error_after_valid_appends_still_syncs_before_the_ack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tl = await _elected_timeline(tmp_path)
    flushed_before = tl.acceptor.flush_lsn

    # Every fdatasync from here on, with the file size it covered.
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def recording_fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        synced.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fdatasync", recording_fdatasync)

    wal = synthetic_wal(START, 8192, system_id=SYSTEM_ID)
    good = AppendRequest(1, START, Lsn(START + len(wal)), INVALID_LSN, INVALID_LSN, wal)
    gap_at = Lsn(START + len(wal) + 8192)
    gap = AppendRequest(1, gap_at, Lsn(gap_at + 16), INVALID_LSN, INVALID_LSN, b"x" * 16)
    replies, pending, error = await tl.write_appends([good, gap])
    assert isinstance(error, AcceptorError) and "gap" in str(error)
    assert replies == []
    assert pending is not None
    await tl.sync(pending)
    resp = await tl.finish(pending)
    # The valid append was acknowledged...
    assert resp.flush_lsn > flushed_before
    # ... so an fdatasync must have run after it was written.
    assert synced, "AppendResponse acknowledged WAL that was never fdatasynced"
    assert tl.storage.flush_lsn == tl.storage.write_lsn


def test_create_makes_the_new_directories_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real = common.fsync.fsync_dir

    def recording(path: Path) -> None:
        real(path)
        synced.append(Path(path))

    monkeypatch.setattr(safekeeper.timeline, "fsync_dir", recording)
    monkeypatch.setattr(safekeeper.control_file, "fsync_dir", recording)
    directory = tmp_path / "data" / TENANT.hex / TIMELINE.hex
    Timeline.create(directory, 1, TENANT, TIMELINE, no_sync=False)
    # The control file's entry, the timeline's entry in its tenant, the tenant's in data_dir.
    assert {directory, directory.parent, directory.parent.parent} <= set(synced)


async def test_a_failed_fdatasync_is_never_retried_into_an_acknowledgement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After EIO from fdatasync Linux may have dropped the dirty pages; a second fdatasync can
    then succeed although the WAL is gone. The timeline must refuse to go on, not ack."""
    tl = await _elected_timeline(tmp_path)
    flushed_before = tl.acceptor.flush_lsn
    real_fdatasync = os.fdatasync
    failures = [OSError(5, "Input/output error")]

    def failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", failing_once)
    wal = synthetic_wal(START, 16384, system_id=SYSTEM_ID)
    half = len(wal) // 2
    first = AppendRequest(1, START, Lsn(START + half), INVALID_LSN, INVALID_LSN, wal[:half])
    _, pending, error = await tl.write_appends([first])
    assert error is None and pending is not None
    with pytest.raises(WalStorageBroken) as info:
        await tl.sync(pending)
    assert info.value.sqlstate == "58030" and isinstance(info.value.__cause__, OSError)
    with pytest.raises(WalStorageBroken):
        await tl.finish(pending)
    assert not failures
    # The next group's fdatasync would succeed now: it must not be attempted, nor acked.
    second = AppendRequest(
        1, Lsn(START + half), Lsn(START + len(wal)), INVALID_LSN, INVALID_LSN, wal[half:]
    )
    with pytest.raises(WalStorageError):
        await tl.write_appends([second])
    with pytest.raises(WalStorageError):
        await tl.process_batch([second])
    assert tl.acceptor.flush_lsn == flushed_before


async def test_syncs_in_flight_are_bounded_and_acks_follow_their_own_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer starts group N+1's fdatasync before N's returned (at most
    SYNCS_IN_FLIGHT at once), yet every AppendResponse leaves after its own group's
    fdatasync, in group order."""
    tl = await _elected_timeline(tmp_path)

    gate = threading.Event()  # holds the first group's fdatasync until the test opens it
    started: list[int] = []
    finished: list[int] = []
    real_fdatasync = tl.storage.fdatasync
    real_sync_handle = tl.storage.sync_handle
    # Which group each sync descriptor belongs to (opened in group order, under the
    # timeline's lock): the worker threads may call fdatasync in any order on a loaded
    # machine, so the call order does not tell the group.
    group_of: dict[int, int] = {}
    numbers = itertools.count(1)

    def numbered_sync_handle() -> int:
        fd = real_sync_handle()
        group_of[fd] = next(numbers)
        return fd

    def slow_first_fdatasync(fd: int) -> None:
        me = group_of[fd]
        started.append(me)
        if me == 1:
            assert gate.wait(10)
        real_fdatasync(fd)
        finished.append(me)

    monkeypatch.setattr(tl.storage, "sync_handle", numbered_sync_handle)
    monkeypatch.setattr(tl.storage, "fdatasync", slow_first_fdatasync)

    recorder = AckRecorder(lambda: list(finished))
    piece = 65536
    groups = 4
    wal = synthetic_wal(START, groups * piece, system_id=SYSTEM_ID)
    send, receive = queued_appends(wal, piece, groups)
    budget = _ByteBudget(1 << 30)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            # max_write_bytes = one message: every message is its own group.
            nursery.start_soon(
                _write_stage, recorder, receive, tl, 3, piece, budget  # type: ignore[arg-type]
            )
            await wait_until(lambda: len(started) >= SYNCS_IN_FLIGHT)
            # Everything that can run without the first fdatasync has run once every task
            # waits: exactly SYNCS_IN_FLIGHT syncs started, nothing acknowledged.
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert len(started) == SYNCS_IN_FLIGHT
            assert recorder.acks == []
            gate.set()
            await send.aclose()
    acks = recorder.acks
    assert [f for f, _ in acks] == sorted(f for f, _ in acks)
    assert len(acks) == groups
    for k, (_flush, done) in enumerate(acks, start=1):
        assert k in done, f"group {k} acknowledged before its fdatasync returned"
    assert acks[-1][0] == tl.acceptor.flush_lsn > START


async def test_each_sync_in_flight_has_its_own_open_file_description(tmp_path: Path) -> None:
    """Linux reports a writeback error once per open file description: if two fdatasyncs
    in flight shared one (``dup``), group 2's could consume the EIO of group 1's pages and
    group 1 would be acknowledged. Each pending sync must therefore open the segment anew
    (a shared description shows as a shared file offset)."""
    tl = await _elected_timeline(tmp_path)
    wal = synthetic_wal(START, 16384, system_id=SYSTEM_ID)
    half = len(wal) // 2
    pendings = []
    for begin, chunk in ((START, wal[:half]), (Lsn(START + half), wal[half:])):
        req = AppendRequest(1, begin, Lsn(begin + len(chunk)), INVALID_LSN, INVALID_LSN, chunk)
        _, pending, error = await tl.write_appends([req])
        assert error is None and pending is not None
        # The group's write (in the WAL IO engine) opened its fdatasync descriptor.
        fd = (await pending.write.wait()).fd
        assert fd >= 0
        pendings.append((pending, fd))
    fds = [tl.storage._fd] + [fd for _, fd in pendings]
    try:
        for k, fd in enumerate(fds):
            os.lseek(fd, 1000 + k, os.SEEK_SET)
        # Each offset is still its own: no two descriptors share an open file description.
        assert [os.lseek(fd, 0, os.SEEK_CUR) for fd in fds] == [1000 + k for k in range(len(fds))]
        # And each names the segment being written.
        seg = os.fstat(tl.storage._fd)
        assert all(os.fstat(fd).st_ino == seg.st_ino for _, fd in pendings)
    finally:
        for p, _ in pendings:
            await tl.sync(p)
    for p, _ in pendings:
        await tl.finish(p)
    assert tl.acceptor.flush_lsn > START


@pytest.mark.parametrize("no_sync", [True, False], ids=["fsync-off", "fsync-on"])
async def test_invalid_wal_in_a_pipelined_group_acks_its_valid_prefix_and_writes_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_sync: bool
) -> None:
    """The records of a pipelined group are checked in the WAL IO engine, so the groups
    behind an invalid one are submitted before the error is known. Group 1's write is held
    until groups 2 (a record damaged) and 3 are submitted; then group 2's valid prefix is
    written and acknowledged, WAL is cut at its last valid record, group 3 and 4 write
    nothing, the stream ends with the proposer's error, and a restart scan finds exactly the
    acknowledged WAL. WAL that continues at the cut is taken again."""
    tl = await elected_timeline(tmp_path / "tl", no_sync=no_sync)
    piece = 65536
    groups = 4
    good = synthetic_wal(START, groups * piece, system_id=SYSTEM_ID)
    wal = bytearray(good)
    wal[piece + 30000] ^= 0x40  # a record in the middle of group 2
    # Invalid WAL refuses its whole AppendRequest: WAL is cut at the last record that ends
    # in group 1.
    tracker = RecordTracker(START)
    cut = Lsn(tracker.feed(good[:piece]))
    assert START + piece - 1000 < cut <= START + piece

    gate = threading.Event()
    written: list[Lsn] = []
    real_write = tl.storage.write_tracked

    def held_first_write(begin: Lsn, group: TrackedGroup) -> None:
        if not written:
            assert gate.wait(10)
        try:
            real_write(begin, group)
        finally:
            written.append(tl.storage.write_lsn)

    monkeypatch.setattr(tl.storage, "write_tracked", held_first_write)
    recorder = AckRecorder(lambda: list(written))
    send, receive = queued_appends(bytes(wal), piece, groups)
    await send.aclose()
    with trio.fail_after(20):
        with pytest.RaisesGroup(InvalidWal, flatten_subgroups=True) as info:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _write_stage, recorder, receive, tl, 3, piece, _ByteBudget(1 << 30)  # type: ignore[arg-type]
                )
                await wait_until(lambda: tl.stats.groups >= 3)
                gate.set()
    # The proposer's error, once: not a refused later group's, nor a storage error.
    errors = info.value.split(InvalidWal)[0]
    assert errors is not None
    leaves = list(_leaves(errors))
    assert len(leaves) == 1 and type(leaves[0]) is InvalidWal and "CRC" in str(leaves[0])
    # Group 1's records are acknowledged (the cut's own acknowledgement covers them when
    # the cut came first); nothing beyond the cut ever is.
    flushes = [flush for flush, _ in recorder.acks]
    assert flushes == sorted(flushes) and flushes[-1] == cut
    assert tl.storage.write_lsn == tl.storage.flush_record_lsn == cut
    assert tl.acceptor.write_lsn == tl.acceptor.flush_lsn == cut
    # Groups 3 and 4 were refused before writing a byte (only groups 1 and 2 reached the
    # write; 3 was submitted before 2 was checked): past the cut the segment holds what a
    # fresh one does.
    assert len(written) == 2 and tl.stats.groups >= 3
    assert tl.storage.read(START, cut - START) == good[: cut - START]
    tail = tl.storage.read(cut, 4 * piece)
    assert tail == bytes(len(tail))
    reopened = WalStorage(tl.storage.directory, no_sync=True)
    assert reopened.open(START) == cut
    # The next proposer continues at the cut: taken again, and past it too.
    storage = tl.storage
    refusing = storage.cut_by_invalid_wal
    group = storage.write_group(cut, [good[cut - START :]])
    assert refusing and group.error is None and not storage.cut_by_invalid_wal
    assert tl.storage.write_lsn == START + len(good)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out
