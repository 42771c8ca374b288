"""One timeline's WAL on disk, as PostgreSQL segment files (blocking; callers use a thread).

Owns the files in ``<data_dir>/<tenant>/<timeline>/``: 16 MiB segments named like
PostgreSQL's (TLI 1), the one being written with the suffix ``.partial``. A new segment is
a zero-filled file preallocated to its full size and fsynced before it is renamed to
``.partial`` (then the directory is fsynced), so a later ``fdatasync`` has no size change to
carry. The write path does not make that file itself when it can help it: when it opens a
segment, a thread of its own makes a *spare* (``SPARE_SEGMENT``), and the write that crosses
into the next segment only renames the spare to ``NAME.partial``; the directory fsync that
makes the new name durable runs with the group's own sync (``sync_directory``: in ``flush``,
or in the pipelined group's sync worker beside its ``fdatasync``), before anything written
there is acknowledged. The spare has no segment's name, so no scan, listing or removal ever
sees it, and a spare left by an earlier process is never used (it is made again).

Rules:
- Writes are strictly sequential (``begin == write_lsn``). ``write`` takes a whole group of
  buffers and issues one ``os.pwritev`` per segment it touches; ``flush`` is one
  ``fdatasync`` of the open segment. A segment written to its end is fdatasynced, renamed to
  its final name and closed right away.
- Every written byte goes through a ``RecordTracker``: ``flush_record_lsn`` (what the
  proposer is told) is the end of the last complete, CRC-valid record that is flushed.
  ``write_group`` checks and writes a group in one call (the WAL IO engine's thread). Invalid
  WAL cuts WAL back to the last valid record; groups written behind it that begin past the
  cut are refused (``FollowsInvalidWal``) until WAL continues at the cut.
- ``truncate`` cuts everything at or after an LSN (zeroes the rest of its segment, deletes
  later segments, renames a completed segment back to ``.partial``).
- ``open`` finds the end of WAL by a CRC-checked record scan from a known record boundary
  (the persisted commit_lsn): the first invalid or missing byte ends WAL.
- ``no_sync`` skips every fsync/fdatasync (tests, benchmarks of the CPU path).
- ``direct_io`` writes the segments with ``O_DIRECT`` (``wal_direct_io``): no copy into the
  page cache, which under a sustained stream is most of a buffered write's CPU.
  ``O_DIRECT`` wants offsets, lengths and buffer addresses in units of ``DIRECT_ALIGN``, so
  every write goes through an aligned staging buffer: it starts at the block holding
  ``write_lsn`` (the bytes before ``write_lsn`` in that block, kept from the previous write
  or read back from the file, are written again unchanged, as a buffered write's page would
  be, so a torn rewrite leaves them as they were) and its last block is padded with zeros,
  which is what a preallocated segment holds past the end of WAL anyway. A write error is the ``pwrite``'s own (no writeback later); the group's
  ``fdatasync`` still commits the extent conversion and flushes the device's cache. Reads
  (replication, the restart scan) stay buffered; the kernel keeps them coherent. A
  filesystem that refuses ``O_DIRECT`` fails the storage's construction, never falls back.
- One thread at a time changes the storage (the WAL IO engine), but the event loop's thread
  publishes a finished group's flush (``mark_flushed``) while the engine may be cutting WAL
  back for a later group's invalid WAL. ``flush_lsn``, ``flush_record_lsn`` and ``epoch``
  change only under ``lsn_lock`` (``write_lsn`` too, except as a write advances it in the
  engine's thread; the event loop reads it only once that write has ended or failed, never
  in ``mark_flushed``), and ``mark_flushed`` checks the group's epoch under it: a flush from
  before a cut or truncation is never published over the LSNs the cut set.
- Any ``OSError`` on the write path leaves the storage ``broken``: a failed ``pwritev``
  (EIO, ENOSPC, a short write that makes no progress), fdatasync, or segment
  create/preallocate/rename/directory fsync, and any IO error during first-segment
  initialisation or truncation. It raises ``WalStorageBroken`` (SQLSTATE 58030), and every
  later write, flush or truncation raises it too until a restart rescans the disk: after a
  failed write the file's content is unknown, and after a failed fsync a retried one may
  succeed over pages the kernel already dropped (PostgreSQL PANICs in both cases).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

from common.fsync import fsync_dir
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn, format_lsn
from protocol.lsn import segment_file_name as _seg_name
from protocol.wal.page import XLP_BKP_REMOVABLE, XLP_FIRST_IS_CONTRECORD, encode_page_header
from safekeeper.direct_write import ALIGN as KERNEL_ALIGN
from safekeeper.direct_write import write_staged
from safekeeper.record_tracker import InvalidWal, RecordTracker

TMP_SEGMENT = "waltmp"
# A zero-filled segment file made ahead of the write, in the background (``_Spare``).
SPARE_SEGMENT = "waltmp.spare"
IOV_MAX = 1024
SCAN_CHUNK = 1 << 20
# The unit of O_DIRECT offsets, lengths and buffer addresses: 4096 covers every logical block
# size Linux filesystems use for it (512 or 4096).
DIRECT_ALIGN = KERNEL_ALIGN
# The staging buffer of direct writes: one default write group (1 MiB) and the block before
# it; bigger pieces are written in several such steps.
DIRECT_STAGE = (1 << 20) + DIRECT_ALIGN

Buffer = bytes | bytearray | memoryview


@attrs.frozen
class TrackedGroup:
    """A write group after record tracking: the valid chunks, the record end after them,
    and the invalid-WAL error that stopped tracking, if any."""

    views: list[memoryview]
    record_end: Lsn
    error: InvalidWal | None



def split_at_segments(
    pos: int, views: Iterable[memoryview], seg_size: int
) -> Iterator[tuple[int, int, list[memoryview], int]]:
    """The bytes of ``views`` (consecutive, starting at WAL position ``pos``) one segment at a
    time: (segment number, offset in it, the views or parts of views that fall in it, size)."""
    queue = deque(v for v in views if len(v))
    while queue:
        segno, offset = divmod(pos, seg_size)
        room = seg_size - offset
        iov: list[memoryview] = []
        size = 0
        while queue and size < room:
            buf = queue.popleft()
            if size + len(buf) > room:
                # This buffer crosses the segment end: the rest goes to the next segment.
                cut = room - size
                iov.append(buf[:cut])
                queue.appendleft(buf[cut:])
                size = room
            else:
                iov.append(buf)
                size += len(buf)
        yield segno, offset, iov, size
        pos += size

class _Spare:
    """A spare segment file being made in a thread of its own (see the module docstring):
    what ``_open_segment`` would do inline before the rename, so that the write path then
    only renames it. A failure here is not the write path's: the storage is not broken by it,
    and the next segment is made inline (where a failure does break the storage)."""

    __slots__ = ("error", "thread")

    def __init__(self, storage: WalStorage) -> None:
        self.error: OSError | None = None
        self.thread = threading.Thread(
            target=self._run, args=(storage,), name="wal-spare-segment", daemon=True
        )
        self.thread.start()

    def _run(self, storage: WalStorage) -> None:
        try:
            storage.make_zeroed_file(SPARE_SEGMENT)
        except OSError as exc:
            self.error = exc


class FollowsInvalidWal(InvalidWal):
    """A write group that begins past the point where an earlier group's invalid WAL cut this
    node's WAL back. It was submitted before that was known (the records are checked in the
    WAL IO engine) and is not written."""


class WalStorageError(Exception):
    """The WAL on disk is not what this node wrote (a bug or outside interference)."""

    # What the connection's ErrorResponse carries.
    sqlstate = "XX000"


class WalStorageBroken(WalStorageError):
    """An IO error on the write path: the storage refuses all further writes until restart."""

    sqlstate = "58030"  # io_error


class WalStorage:
    """See the module docstring. One caller at a time, except ``mark_flushed``."""

    def __init__(
        self, directory: Path, *, seg_size: int = WAL_SEGMENT_SIZE, no_sync: bool = False,
        direct_io: bool = False,
    ) -> None:
        self.directory = directory
        self.seg_size = seg_size
        self.no_sync = no_sync
        self.direct_io = direct_io
        # Direct writes: the aligned staging buffer (made at the first write), and the file
        # block its first DIRECT_ALIGN bytes hold, as (segment, offset) of that block's
        # start, or None when they hold nothing known.
        self._stage: memoryview | None = None
        self._stage_block: tuple[int, int] | None = None
        # Direct and durable: a write group is made durable by its own write call (the
        # write kernel's fdatasync after the group's last write, then the directory's if a
        # segment was renamed in), on the WAL IO engine's thread and without the GIL; there is
        # no later sync worker to hand it to. ``synced_lsn``: WAL up to here is durable that
        # way (``sync_handle`` and ``flush`` have nothing left to do below it).
        self.sync_in_write = direct_io and not no_sync
        self.synced_lsn = INVALID_LSN
        if direct_io:
            if seg_size % DIRECT_ALIGN:
                raise WalStorageError(
                    f"direct IO needs a segment size that is a multiple of {DIRECT_ALIGN}, "
                    f"not {seg_size}"
                )
            self._probe_direct()
        # Guards write_lsn/flush_lsn/flush_record_lsn/epoch between the WAL IO engine's thread
        # and mark_flushed on the event loop's thread (see the module docstring).
        self.lsn_lock = threading.Lock()
        self.write_lsn = INVALID_LSN
        self.flush_lsn = INVALID_LSN
        self.flush_record_lsn = INVALID_LSN
        self._tracker: RecordTracker | None = None
        self._fd = -1
        # The open segment's path (sync_handle opens it once per write group).
        self._fd_path = ""
        self._segno = -1
        self.fsync_count = 0
        # Bumped by every open/truncate: a flush started before one must not be published.
        self.epoch = 0
        # The first IO error of the write path. After a failed fsync Linux may have dropped
        # the dirty pages and a retried fsync can then succeed over lost data; after a failed
        # or short write the file holds an unknown mix of old and new bytes. Either way
        # nothing more is written or acknowledged until a restart rescans what is really on
        # disk (PostgreSQL PANICs for the same reasons).
        self.broken: OSError | None = None
        # Set when a group's invalid WAL cut WAL back to its last valid record: groups
        # submitted behind it, which start further on, are refused (``write_group``) until
        # WAL continues at the cut.
        self.cut_by_invalid_wal = False
        # The spare segment file being made in the background (``_Spare``), and whether a
        # made one is ready to be renamed in.
        self._spare: _Spare | None = None
        self._spare_ready = False
        self.spares_used = 0  # segments the write path took from a spare
        # Segment files the write path renamed into place without fsyncing the directory
        # (counted in the engine's thread), and how many of those renames a directory fsync
        # has made durable since (under lsn_lock: two group syncs may run at once). The
        # fsync runs with the group's fdatasync (``sync_directory``), off the write path,
        # and before anything in the new segment is acknowledged.
        self.dir_changes = 0
        self._dir_synced = 0

    def _probe_direct(self) -> None:
        """Fail now, with the reason, if this directory's filesystem refuses ``O_DIRECT``."""
        probe = self.directory / (TMP_SEGMENT + ".direct-probe")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as exc:
            raise WalStorageError(
                f"wal_direct_io is on, but {self.directory} refuses O_DIRECT ({exc}); "
                "turn wal_direct_io off or put the data directory on a filesystem that has it"
            ) from exc
        os.close(fd)
        probe.unlink()

    # -- naming ------------------------------------------------------------------------------

    def segment_name(self, segno: int) -> str:
        return _seg_name(segno, segment_size=self.seg_size)

    def segment_path(self, segno: int) -> Path | None:
        """The file holding ``segno``, complete or ``.partial``; None if there is none.

        The ``.partial`` name is looked at first: while WAL is written, a completed segment is
        renamed (in another thread) from ``.partial`` to its full name, so a segment renamed
        between the two looks is still found (the other order can miss it). The way back, a
        truncation at an election, bumps the epoch, and reads across it are dropped."""
        for path in self._segment_names(segno):
            if path.exists():
                return path
        return None

    def _segment_names(self, segno: int) -> tuple[Path, Path]:
        full = self.directory / self.segment_name(segno)
        return full.with_name(full.name + ".partial"), full

    def segments(self) -> list[int]:
        out = []
        for entry in os.listdir(self.directory):
            base = entry.removesuffix(".partial")
            if len(base) == 24 and base.isalnum() and base.upper() == base:
                try:
                    out.append(int(base[8:16], 16) * (0x1_0000_0000 // self.seg_size) + int(base[16:], 16))
                except ValueError:
                    continue
        return sorted(out)

    # -- open / restart ----------------------------------------------------------------------

    def open(self, scan_from: Lsn) -> Lsn:
        """Find the end of WAL from the record boundary ``scan_from`` (0: there is no WAL)."""
        self.close()
        with self.lsn_lock:
            self.epoch += 1
        self.cut_by_invalid_wal = False
        self.synced_lsn = INVALID_LSN
        if scan_from == INVALID_LSN:
            with self.lsn_lock:
                self.write_lsn = self.flush_lsn = self.flush_record_lsn = INVALID_LSN
            self._tracker = None
            return INVALID_LSN
        end = self.scan_end_of_wal(scan_from)
        if not self.no_sync:
            self._fsync_scanned(scan_from, end)
        with self.lsn_lock:
            self.write_lsn = self.flush_lsn = self.flush_record_lsn = end
        self._tracker = RecordTracker(end, self.seg_size)
        return end

    def _fsync_scanned(self, start: Lsn, end: Lsn) -> None:
        """fsync the segments the scan accepted before ``end`` is reported as flushed: a
        previous process may have died (or broken its storage) between a write and its
        fdatasync, and those bytes are then only in the page cache. PostgreSQL syncs its
        data directory at crash recovery for the same reason. An error here fails the load."""
        for segno in range(start // self.seg_size, (max(end, 1) - 1) // self.seg_size + 1):
            path = self.segment_path(segno)
            if path is None:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def scan_end_of_wal(self, start: Lsn) -> Lsn:
        tracker = RecordTracker(start, self.seg_size)
        pos = start
        try:
            while True:
                segno = pos // self.seg_size
                path = self.segment_path(segno)
                if path is None:
                    break
                with open(path, "rb") as f:
                    f.seek(pos % self.seg_size)
                    while pos // self.seg_size == segno:
                        want = min(SCAN_CHUNK, (segno + 1) * self.seg_size - pos)
                        data = f.read(want)
                        if not data:
                            break
                        tracker.feed(data)
                        pos = Lsn(pos + len(data))
                        if len(data) < want:
                            break
                if pos // self.seg_size == segno:
                    break
        except InvalidWal:
            pass
        return tracker.record_end

    # -- segments ----------------------------------------------------------------------------

    def _open_segment(self, segno: int, make_spare: bool = False) -> int:
        """The open segment's descriptor, opening (or making) ``segno``'s file first if
        needed. ``make_spare`` (the write path): have a spare made for the next segment."""
        if self._segno == segno and self._fd >= 0:
            if make_spare and not self._spare_ready and self._spare is None:
                self._start_spare()  # the segment was opened by a truncation or a restart
            return self._fd
        self._close_fd()
        final = self.directory / self.segment_name(segno)
        partial = final.with_name(final.name + ".partial")
        if final.exists():
            raise WalStorageError(f"segment {final.name} is complete but WAL is being written there")
        if not partial.exists():
            self.join_spare()
            if self._spare_ready:
                self._spare_ready = False
                os.rename(self.directory / SPARE_SEGMENT, partial)
                self.spares_used += 1
            else:
                self.make_zeroed_file(TMP_SEGMENT)
                os.rename(self.directory / TMP_SEGMENT, partial)
            if self.no_sync:
                pass
            elif make_spare:
                self.dir_changes += 1  # the write path: synced with the group (flush, sync)
            else:
                fsync_dir(self.directory)
        self._fd = os.open(partial, os.O_RDWR | (os.O_DIRECT if self.direct_io else 0))
        self._fd_path = str(partial)
        self._segno = segno
        if make_spare and not self._spare_ready and self._spare is None:
            self._start_spare()
        return self._fd

    def make_zeroed_file(self, name: str) -> None:
        """A file of one segment's size in the directory: all zeros, its blocks allocated,
        fsynced (its name is made durable by the rename that follows)."""
        fd = os.open(self.directory / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.seg_size)
            if not self.no_sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _start_spare(self) -> None:
        if self.broken is None:
            self._spare = _Spare(self)

    def join_spare(self) -> None:
        """Wait for the spare being made, if one is; a failed one is removed (the next
        segment is then made inline)."""
        spare = self._spare
        if spare is None:
            return
        spare.thread.join()
        self._spare = None
        self._spare_ready = spare.error is None
        if spare.error is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / SPARE_SEGMENT)

    def fdatasync(self, fd: int) -> None:
        """``os.fdatasync`` that marks the storage broken when it fails."""
        if self.broken is not None:
            self.check_usable()
        try:
            os.fdatasync(fd)
        except OSError as exc:
            raise self._broke(exc, "fdatasync of a WAL segment") from exc

    def dir_sync_due(self, changes: int) -> bool:
        """Whether ``sync_directory(changes)`` has a directory fsync to do."""
        return changes > self._dir_synced

    def sync_directory(self, changes: int) -> None:
        """Make the first ``changes`` renames of ``dir_changes`` durable (one directory fsync
        unless an earlier call covered them); marks the storage broken when it fails. Any
        thread: a group's sync worker calls it before its reply may leave."""
        if changes <= self._dir_synced:
            return
        if self.broken is not None:
            self.check_usable()
        try:
            fsync_dir(self.directory)
        except OSError as exc:
            raise self._broke(exc, "fsync of the WAL directory") from exc
        with self.lsn_lock:
            self._dir_synced = max(self._dir_synced, changes)

    def _broke(self, exc: OSError, what: str) -> WalStorageBroken:
        """Mark the storage broken by ``exc``; the error to raise from it."""
        if self.broken is None:
            self.broken = exc
        return WalStorageBroken(
            f"{what} failed: {exc}; this timeline's WAL is refused until the safekeeper restarts"
        )

    @contextmanager
    def write_io(self, what: str) -> Iterator[None]:
        """Turn any ``OSError`` inside into a broken storage and ``WalStorageBroken``
        (the per-group hot paths use ``_broke`` directly: a context manager costs more)."""
        try:
            yield
        except OSError as exc:
            raise self._broke(exc, what) from exc

    def check_usable(self) -> None:
        if self.broken is not None:
            raise WalStorageBroken(
                f"an IO error on this timeline's WAL ({self.broken}) broke its storage; "
                "nothing more is written or acknowledged until the safekeeper restarts"
            )

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self._segno = -1
        self._stage_block = None

    def _complete_segment(self) -> None:
        """The open segment is full: make it durable and give it its final name."""
        if not self.no_sync:
            self.fdatasync(self._fd)
            self.fsync_count += 1
        name = self.segment_name(self._segno)
        self._close_fd()
        os.rename(self.directory / (name + ".partial"), self.directory / name)

    def close(self) -> None:
        self._close_fd()
        self.join_spare()

    # -- write path --------------------------------------------------------------------------

    def write(self, begin: Lsn, chunks: Sequence[Buffer]) -> None:
        """Append ``chunks`` at ``begin``: ``track`` then ``write_tracked``."""
        self.write_tracked(begin, self.track(begin, chunks))

    def write_group(self, begin: Lsn, chunks: Sequence[Buffer]) -> TrackedGroup:
        """One write group, checked and written in one call (the WAL IO engine's thread
        runs it, so the record checks and CRCs leave the event loop's thread): ``track``
        then ``write_tracked``, which raises ``InvalidWal`` after writing the valid prefix
        and cutting WAL back to its last record.

        Groups are submitted before the groups ahead of them were checked, so one that
        begins past such a cut raises ``FollowsInvalidWal`` and writes nothing; a group
        that begins exactly at the cut (the next proposer's, after the acceptor followed
        the cut) goes on normally."""
        if self.cut_by_invalid_wal:
            if begin != self.write_lsn:
                raise FollowsInvalidWal(
                    f"WAL from {format_lsn(begin)} follows invalid WAL that ended this "
                    f"node's WAL at {format_lsn(self.write_lsn)}; it was not written"
                )
            self.cut_by_invalid_wal = False
        group = self.track(begin, chunks)
        self.write_tracked(begin, group)
        return group

    def track(self, begin: Lsn, chunks: Sequence[Buffer]) -> TrackedGroup:
        """The CPU half of a write: feed the chunks to the record tracker (page headers and
        CRCs checked). Pure computation, so it may run on the event loop's thread while the
        IO half of the previous group runs in a worker thread."""
        self.check_usable()
        tracker = self._tracker
        if tracker is None:
            raise WalStorageError("write before the first election initialised WAL")
        if begin != tracker.pos:
            raise WalStorageError(
                f"tracking at {format_lsn(begin)} but the tracker is at {format_lsn(tracker.pos)}"
            )
        views = [memoryview(chunk).cast("B") for chunk in chunks]
        # All chunks in one kernel call: the compiled tracker checks them without taking the
        # GIL back between chunks (the writer thread would wait for it each time).
        fed, good_end, error = tracker.feed_many(views)
        if error is not None:
            return TrackedGroup(views[:fed], good_end, error)
        return TrackedGroup(views, good_end, None)

    def write_tracked(self, begin: Lsn, group: TrackedGroup) -> None:
        """The IO half: one ``pwritev`` per segment. Invalid WAL raises ``InvalidWal`` after
        the valid chunks were written and WAL was cut back to the last valid record's end, so
        that storage and tracker agree again."""
        self.check_usable()
        if begin != self.write_lsn:
            raise WalStorageError(
                f"write at {format_lsn(begin)} but write_lsn is {format_lsn(self.write_lsn)}"
            )
        try:
            self._pwrite_group(begin, group.views)
        except OSError as exc:
            raise self._broke(exc, "writing WAL") from exc
        if group.error is not None:
            # The tracker's state is garbage; truncate() syncs and starts a new one.
            self.truncate(group.record_end)
            self.cut_by_invalid_wal = True
            raise group.error

    def _pwrite_group(self, begin: Lsn, views: list[memoryview]) -> None:
        pos = begin
        end = begin + sum(len(v) for v in views)
        for segno, offset, iov, size in split_at_segments(begin, views, self.seg_size):
            fd = self._open_segment(segno, make_spare=True)
            completes = offset + size == self.seg_size
            # The group's last piece syncs in the write itself (sync_in_write), unless it
            # completes its segment: _complete_segment syncs that one.
            sync = self.sync_in_write and pos + size == end and not completes
            self._write_at(fd, iov, offset, size, sync)
            pos = Lsn(pos + size)
            self.write_lsn = pos
            if sync:
                self.fsync_count += 1
            if completes:
                # Durable now; flush_record_lsn follows in flush(), because the tracker has
                # already seen the whole group and cannot say which record ended here.
                self._complete_segment()
                with self.lsn_lock:
                    self.flush_lsn = Lsn(max(self.flush_lsn, pos))
        if self.sync_in_write and pos > begin:
            # A segment renamed in by this group: its name is durable before the ack too.
            self.sync_directory(self.dir_changes)
            self.synced_lsn = pos

    def _write_at(
        self, fd: int, iov: list[memoryview], offset: int, size: int, sync: bool = False
    ) -> None:
        """Write ``iov`` (``size`` bytes) at ``offset`` of the open segment ``fd``; ``sync``
        (direct IO only): fdatasync it in the same call."""
        if self.direct_io:
            self._direct_write(fd, iov, offset, size, sync)
        else:
            assert not sync, "buffered writes are synced by flush() or the group's sync worker"
            self._pwritev_all(fd, iov, offset, size)

    def _direct_write(
        self, fd: int, iov: list[memoryview], offset: int, size: int, sync: bool
    ) -> None:
        """The ``O_DIRECT`` write (module docstring): the block before ``offset`` completed
        from the previous write or the file, then the staged copies, writes and (``sync``)
        the fdatasync in one call of the write kernel (``safekeeper.direct_write``)."""
        stage = self._stage
        if stage is None:
            stage = self._stage = memoryview(mmap.mmap(-1, DIRECT_STAGE))
        start = offset - offset % DIRECT_ALIGN
        head = offset - start
        if head and self._stage_block != (self._segno, start):
            self._preadv_all(fd, stage[:DIRECT_ALIGN], start)
        self._stage_block = None  # until the kernel has kept the tail below
        kept = write_staged(fd, stage, head, iov, start, sync)
        if kept:
            # The last, partial block is at the stage's start for the next write.
            self._stage_block = (self._segno, offset + size - kept)

    @staticmethod
    def _preadv_all(fd: int, buf: memoryview, offset: int) -> None:
        got = os.preadv(fd, [buf], offset)
        if got != len(buf):
            raise OSError(errno.EIO, f"read {got} of {len(buf)} bytes at offset {offset} of a WAL segment")

    @staticmethod
    def _pwritev_all(fd: int, iov: list[memoryview], offset: int, size: int) -> None:
        done = 0
        start = 0
        while done < size:
            batch = iov[start : start + IOV_MAX]
            n = os.pwritev(fd, batch, offset + done)
            if n <= 0:
                # No progress and no errno (PostgreSQL assumes a full disk in this case too).
                raise OSError(errno.ENOSPC, f"pwritev wrote nothing at offset {offset + done}")
            done += n
            # Drop fully written buffers; keep the rest of a partially written one.
            rest: list[memoryview] = []
            skip = n
            for b in iov[start:]:
                if skip >= len(b):
                    skip -= len(b)
                    continue
                rest.append(b[skip:])
                skip = 0
            iov, start = rest, 0

    def sync_handle(self) -> int:
        """A descriptor of the open segment for an ``fdatasync`` that runs while the next
        group is written (-1 when no segment is open: everything is durable). The caller
        closes it.

        It is a new *open file description* (``open``), not a ``dup``: Linux reports a
        writeback error once per open file description (errseq), so with two fdatasyncs in
        flight on dup'ed descriptors the later group's call could take the EIO that belongs
        to the earlier group's pages, and the earlier group would be acknowledged over lost
        WAL. A description opened before the failed writeback reports it on its own."""
        if self._fd < 0 or self.no_sync or self.synced_lsn >= self.write_lsn:
            return -1
        try:
            # The open segment is always the .partial file (it is renamed only when closed).
            return os.open(self._fd_path, os.O_RDONLY)
        except OSError as exc:
            raise self._broke(exc, "opening a WAL segment for fdatasync") from exc

    def mark_flushed(self, epoch: int, write_lsn: Lsn, record_end: Lsn) -> bool:
        """An ``fdatasync`` that started after ``write_lsn`` was written (in ``epoch``) has
        completed: publish it, unless a cut or truncation has bumped the epoch since (then
        the LSNs it set stand, and this returns False). Called on the event loop's thread
        while the engine's thread may be cutting WAL back: the check and the update are one
        step under ``lsn_lock``, as are the cut's epoch bump and its LSNs."""
        with self.lsn_lock:
            if epoch != self.epoch:
                return False
            self.flush_lsn = Lsn(max(self.flush_lsn, write_lsn))
            self.flush_record_lsn = Lsn(max(self.flush_record_lsn, record_end))
            return True

    def flush(self) -> Lsn:
        """Make everything written durable; returns the new ``flush_record_lsn``."""
        self.check_usable()
        self.sync_directory(self.dir_changes)
        if (
            self._fd >= 0 and self.flush_lsn < self.write_lsn and not self.no_sync
            and self.synced_lsn < self.write_lsn
        ):
            self.fdatasync(self._fd)
            self.fsync_count += 1
        with self.lsn_lock:
            self.flush_lsn = self.write_lsn
            if self._tracker is not None:
                self.flush_record_lsn = self._tracker.record_end
            return self.flush_record_lsn

    # -- election-time operations ------------------------------------------------------------

    def init_first_segment(self, lsn: Lsn, system_id: int) -> None:
        """Write the page headers a proposer does not send when WAL starts at ``lsn``.

        Every page from the segment start up to ``lsn``'s page gets a header marking its
        content as the continuation of a record that ends exactly at ``lsn``. PostgreSQL's
        readers (pg_waldump, a standby) look for the first record of a segment or page by
        skipping ``xlp_rem_len`` continuation bytes, so they land on ``lsn`` itself.
        """
        segno = lsn // self.seg_size
        seg_start = segno * self.seg_size
        last_page = lsn - lsn % XLOG_BLCKSZ
        if lsn == last_page:
            # The proposer sends the header of lsn's page itself.
            last_page -= XLOG_BLCKSZ
        if last_page < seg_start:
            return
        self.check_usable()
        headers: list[tuple[int, bytes]] = []
        rem_len = 0
        page = last_page
        while page >= seg_start:
            hdr_size = 40 if page == seg_start else 24
            rem_len += min(lsn, page + XLOG_BLCKSZ) - (page + hdr_size)
            info = XLP_BKP_REMOVABLE | (XLP_FIRST_IS_CONTRECORD if rem_len else 0)
            hdr = encode_page_header(
                page, info=info, rem_len=rem_len, sysid=system_id, segment_size=self.seg_size
            )
            headers.append((page - seg_start, hdr))
            page -= XLOG_BLCKSZ
        image = bytearray(last_page + XLOG_BLCKSZ - seg_start)
        for offset, hdr in headers:
            image[offset : offset + len(hdr)] = hdr
        self.synced_lsn = INVALID_LSN  # these headers are synced by the next flush
        with self.write_io("initialising the first WAL segment"):
            fd = self._open_segment(segno)
            # Only the bytes before lsn: what follows is the proposer's.
            self._write_at(fd, [memoryview(image)[: lsn - seg_start]], 0, lsn - seg_start)

    def truncate(self, lsn: Lsn) -> None:
        """Forget all WAL at and after ``lsn`` (a record boundary); WAL continues there."""
        self.check_usable()
        with self.lsn_lock:
            # From here no flush of an earlier group is published (mark_flushed).
            self.epoch += 1
        self.cut_by_invalid_wal = False
        self.synced_lsn = INVALID_LSN
        if self._fd >= 0 and not self.no_sync:
            self.fdatasync(self._fd)
        with self.write_io(f"truncating WAL at {format_lsn(lsn)}"):
            self._truncate_files(lsn)
        with self.lsn_lock:
            self.write_lsn = self.flush_lsn = self.flush_record_lsn = lsn
        self._tracker = RecordTracker(lsn, self.seg_size)

    def _truncate_files(self, lsn: Lsn) -> None:
        self._close_fd()
        segno = lsn // self.seg_size
        for other in self.segments():
            if other > segno:
                path = self.segment_path(other)
                if path is not None:
                    path.unlink()
        offset = lsn % self.seg_size
        path = self.segment_path(segno)
        if path is not None and not path.name.endswith(".partial"):
            os.rename(path, path.with_name(path.name + ".partial"))
        fd = self._open_segment(segno)
        # Zero the tail so a later restart scan cannot mistake old WAL for new.
        os.ftruncate(fd, offset)
        os.posix_fallocate(fd, 0, self.seg_size)
        if not self.no_sync:
            os.fsync(fd)
            fsync_dir(self.directory)

    # -- removal -----------------------------------------------------------------------------

    def remove_segments_below(self, segno: int) -> list[int]:
        """Delete every segment file numbered below ``segno`` (the caller decided no consumer
        needs them); returns the numbers removed. Refuses to touch the segment holding the
        flushed WAL end or anything after it."""
        limit = self.flush_record_lsn // self.seg_size
        if segno > limit:
            raise WalStorageError(
                f"refusing to remove WAL segments below {self.segment_name(segno)}: the flushed "
                f"WAL ends in {self.segment_name(limit)}"
            )
        removed = []
        for other in self.segments():
            if other >= segno:
                break
            path = self.segment_path(other)
            if path is not None:
                path.unlink()
                removed.append(other)
        if removed and not self.no_sync:
            fsync_dir(self.directory)
        return removed

    # -- read path (replication) -------------------------------------------------------------

    def read(self, lsn: Lsn, size: int) -> bytes:
        """Up to ``size`` bytes at ``lsn``, never crossing a segment end."""
        segno = lsn // self.seg_size
        size = min(size, (segno + 1) * self.seg_size - lsn)
        # Opened by name in segment_path's order, not looked up and then opened: the rename
        # could fall between the look and the open.
        for path in self._segment_names(segno):
            try:
                fd = os.open(path, os.O_RDONLY)
                break
            except FileNotFoundError:
                continue
        else:
            raise WalStorageError(f"WAL segment {self.segment_name(segno)} is not here")
        try:
            return os.pread(fd, size, lsn % self.seg_size)
        finally:
            os.close(fd)
