"""The pipelined writer never acknowledges WAL that no fdatasync has covered, even when the
group that wrote it ended in a proposer error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import safekeeper.control_file
import safekeeper.timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn
from protocol.safekeeper import (
    AppendRequest,
    ProposerElected,
    ProposerGreeting,
    TermSwitchEntry,
    VoteRequest,
)
from safekeeper.acceptor import AcceptorError
from safekeeper.testing import synthetic_wal
from safekeeper.timeline import Timeline
from safekeeper.wal_storage import WalStorageError

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
START = Lsn(WAL_SEGMENT_SIZE + 40)


async def test_error_after_valid_appends_still_syncs_before_the_ack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tl = Timeline.create(tmp_path / "tl", 1, TENANT, TIMELINE, no_sync=False)
    greeting = ProposerGreeting(
        tenant_id=TENANT, timeline_id=TIMELINE, pg_version=150000, system_id=7,
        wal_seg_size=WAL_SEGMENT_SIZE,
    )
    elected = ProposerElected(1, START, (TermSwitchEntry(1, START),))
    _, error = await tl.process_batch([greeting, VoteRequest(1), elected])
    assert error is None
    flushed_before = tl.acceptor.flush_lsn

    # Every fdatasync from here on, with the file size it covered.
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def recording_fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        synced.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fdatasync", recording_fdatasync)

    wal = synthetic_wal(START, 8192, system_id=7)
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
    real = safekeeper.control_file.fsync_dir

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
    tl = Timeline.create(tmp_path / "tl", 1, TENANT, TIMELINE, no_sync=False)
    greeting = ProposerGreeting(
        tenant_id=TENANT, timeline_id=TIMELINE, pg_version=150000, system_id=7,
        wal_seg_size=WAL_SEGMENT_SIZE,
    )
    elected = ProposerElected(1, START, (TermSwitchEntry(1, START),))
    _, error = await tl.process_batch([greeting, VoteRequest(1), elected])
    assert error is None
    flushed_before = tl.acceptor.flush_lsn
    real_fdatasync = os.fdatasync
    failures = [OSError(5, "Input/output error")]

    def failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", failing_once)
    wal = synthetic_wal(START, 16384, system_id=7)
    half = len(wal) // 2
    first = AppendRequest(1, START, Lsn(START + half), INVALID_LSN, INVALID_LSN, wal[:half])
    _, pending, error = await tl.write_appends([first])
    assert error is None and pending is not None
    with pytest.raises(OSError):
        await tl.sync(pending)
    with pytest.raises(RuntimeError):
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
