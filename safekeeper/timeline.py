"""One timeline on a safekeeper: the acceptor, its WAL storage and the LSNs others wait on.

Owns the glue between the pure ``Acceptor`` and the blocking ``WalStorage`` /
control-file IO: ``process_batch`` runs a batch of proposer messages under the timeline's
lock, carries out the acceptor's effects in order (blocking IO off the event loop's thread), writes
all the batch's WAL as one group with one flush, and returns the replies. ``flush_lsn`` and
``commit_lsn`` are ``trio_util.AsyncValue`` s: replication senders wait on ``commit_lsn``.
``remove_old_wal`` deletes segments below the removal horizon (``safekeeper.wal_removal``),
saving the control file first when its ``commit_lsn`` would otherwise point into them;
``advance_backup`` records a segment the WAL backup stored (``safekeeper.wal_backup``).

Concurrency: any number of push connections and senders may share a timeline; the lock makes
acceptor transitions and WAL writes one at a time. Every call that changes the WAL storage
runs in the timeline's WAL IO engine (``safekeeper.wal_io``: a writer thread or trio's
threadpool), in submission order. Senders only read completed bytes below ``commit_lsn``,
so they never need the lock.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import structlog
import trio
import trio_util

from common.fsync import fsync_dir
from common.metrics import BATCH_BUCKETS
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn, format_lsn
from protocol.safekeeper import (
    AcceptorMessage,
    AppendRequest,
    AppendResponse,
    PageserverFeedback,
    ProposerMessage,
)
from safekeeper.acceptor import (
    Acceptor,
    AcceptorError,
    InitFirstSegment,
    PersistControl,
    Reply,
    TruncateWal,
    WriteWal,
)
from safekeeper.control_file import (
    ControlFile,
    ControlFileError,
    PersistentState,
)
from safekeeper.record_tracker import InvalidWal
from safekeeper.wal_backup import BackupStatus
from safekeeper.wal_io import Job, WalIo, WalIoEngine
from safekeeper.wal_removal import first_kept_segment, removal_horizon
from safekeeper.wal_storage import FollowsInvalidWal, WalStorage, WalStorageError

log = structlog.get_logger("safekeeper.timeline")

@attrs.define
class ReplicaState:
    """What one replication receiver last told us (standby status / hot standby feedback)."""

    name: str
    write_lsn: Lsn = INVALID_LSN
    flush_lsn: Lsn = INVALID_LSN
    apply_lsn: Lsn = INVALID_LSN
    hs_xmin: int = 0
    hs_catalog_xmin: int = 0
    sent_lsn: Lsn = INVALID_LSN
    last_reply: float = 0.0
    # Where this stream started: what the receiver needs until it reports a flush position.
    start_lsn: Lsn = INVALID_LSN

    @property
    def needs_from(self) -> Lsn:
        """The lowest LSN this live receiver may still ask for (after a reconnection too)."""
        return Lsn(max(self.flush_lsn, self.start_lsn))


@attrs.frozen
class Written:
    """What a write group's call in the WAL IO engine did: its records checked (page
    headers, CRCs) and its valid bytes written.

    ``fd`` is the descriptor for the group's fdatasync (-1: none needed), ``fsyncs`` the
    fsyncs the write did itself (segments completed), ``write_lsn`` where the storage's WAL
    ended after it, ``record_end`` the end of the last complete valid record in it, and
    ``epoch`` the storage's epoch after it. ``error`` is the invalid WAL that stopped it:
    its valid prefix is written and WAL was cut back to ``record_end``
    (``FollowsInvalidWal``: the group came after such a cut and nothing of it was written)."""

    fd: int
    fsyncs: int
    write_lsn: Lsn
    record_end: Lsn
    epoch: int
    error: InvalidWal | None = None
    # ``WalStorage.dir_changes`` after the write: the sync also fsyncs the directory if a
    # segment renamed into place by this group (or an earlier one) is not durable yet.
    dir_changes: int = 0


@attrs.define(eq=False)
class PendingFlush:
    """A submitted write group whose write and fdatasync have not been published yet.

    ``write`` is the group's call in the timeline's WAL IO engine (``Written``);
    ``write_lsn`` is where the group ends if all of it is valid."""

    write: Job[Written]
    write_lsn: Lsn
    # WAL bytes of the group's messages, released from the connection's byte budget once
    # the write is done (the messages' receive memory is free then).
    wal_bytes: int = 0
    done: trio.Event = attrs.field(factory=trio.Event)
    error: BaseException | None = None
    # sync() was started or scheduled for it (set by whoever does; finish() runs it itself
    # only with fsync off and only if nobody did).
    syncing: bool = False
    # The write's outcome, once sync() has waited for it.
    written: Written | None = None
    # Set by finish(): the group's invalid WAL, the proposer's error to raise once the
    # acknowledgement of its valid prefix is sent.
    invalid: InvalidWal | None = None


@attrs.define
class WriteStats:
    groups: int = 0
    messages: int = 0
    bytes: int = 0
    fsyncs: int = 0
    appends_in_groups: int = 0
    # Histogram of AppendRequests per write group (upper bounds, counts per bucket).
    group_buckets: tuple[int, ...] = BATCH_BUCKETS
    group_counts: list[int] = attrs.field(factory=lambda: [0] * len(BATCH_BUCKETS))

    def record_group(self, appends: int, nbytes: int) -> None:
        self.groups += 1
        self.bytes += nbytes
        self.appends_in_groups += appends
        self.group_counts[min(bisect.bisect_left(self.group_buckets, appends), len(self.group_buckets) - 1)] += 1


class Timeline:
    def __init__(
        self,
        directory: Path,
        acceptor: Acceptor,
        storage: WalStorage,
        *,
        no_sync: bool,
        wal_io_engine: WalIoEngine = "writer-thread",
        control: ControlFile | None = None,
    ) -> None:
        self.directory = directory
        # Written in place (one pwrite + fdatasync) once it has read or made the file.
        self.control = control if control is not None else ControlFile(directory, no_sync=no_sync)
        self.acceptor = acceptor
        self.storage = storage
        self.no_sync = no_sync
        # Every call that changes ``storage`` goes through this engine, in order.
        self.io = WalIo(wal_io_engine)
        self.lock = trio.Lock()
        self.flush_lsn: trio_util.AsyncValue[Lsn] = trio_util.AsyncValue(acceptor.flush_lsn)
        self.commit_lsn: trio_util.AsyncValue[Lsn] = trio_util.AsyncValue(acceptor.commit_lsn)
        self.term: trio_util.AsyncValue[int] = trio_util.AsyncValue(acceptor.term)
        self.persisted = acceptor.persisted_state()
        self.replicas: dict[int, ReplicaState] = {}
        self.stats = WriteStats()
        self.push_connections = 0
        # The latest feedback a pageserver sent on a replication stream ('z').
        self.ps_feedback: PageserverFeedback | None = None
        # Segments below this number were removed (or are being removed) by WAL removal.
        self.wal_removed_below = 0
        # WAL backup progress on this node (safekeeper.wal_backup); enabled by the node.
        self.backup = BackupStatus()

    @property
    def tenant_id(self) -> TenantId:
        return self.acceptor.state.tenant_id

    @property
    def timeline_id(self) -> TimelineId:
        return self.acceptor.state.timeline_id

    @classmethod
    def load(
        cls, directory: Path, node_id: int, *, no_sync: bool,
        wal_io_engine: WalIoEngine = "writer-thread", direct_io: bool = False,
    ) -> Timeline:
        """Open an existing timeline: read the control file, scan for the end of WAL."""
        control = ControlFile(directory, no_sync=no_sync)
        state = control.read()
        if state is None:
            raise FileNotFoundError(f"no control file in {directory}")
        storage = WalStorage(
            directory, seg_size=state.wal_seg_size, no_sync=no_sync, direct_io=direct_io
        )
        commit = state.commit_lsn
        if commit % state.wal_seg_size and storage.segment_path(commit // state.wal_seg_size) is None:
            # The scan would end WAL right at commit_lsn and report it as flushed: votes and
            # peers would be told of WAL this node does not have. WAL removal never removes
            # this segment, so someone deleted it.
            raise ControlFileError(
                f"{directory}: the WAL segment {storage.segment_name(commit // state.wal_seg_size)} "
                f"holding commit_lsn {format_lsn(commit)} is missing"
            )
        end = storage.open(commit)
        log.info(
            "timeline loaded", path=str(directory), term=state.term, end_of_wal=f"{end:X}"
        )
        return cls(
            directory, Acceptor(node_id, state, end), storage, no_sync=no_sync,
            wal_io_engine=wal_io_engine, control=control,
        )

    @classmethod
    def create(
        cls, directory: Path, node_id: int, tenant_id: TenantId, timeline_id: TimelineId, *,
        no_sync: bool, wal_io_engine: WalIoEngine = "writer-thread", direct_io: bool = False,
    ) -> Timeline:
        directory.mkdir(parents=True, exist_ok=True)
        if has_wal_segments(directory):
            # Its control file is gone: a fresh one would restart the terms at 0 over WAL
            # that earlier terms wrote and votes that were given.
            raise ControlFileError(
                f"{directory}: holds WAL segments but no control file; refusing to create the "
                "timeline over them"
            )
        state = PersistentState(tenant_id=tenant_id, timeline_id=timeline_id)
        # Made first: a filesystem that refuses direct IO stops the creation here, before a
        # control file claims the timeline.
        storage = WalStorage(
            directory, seg_size=state.wal_seg_size, no_sync=no_sync, direct_io=direct_io
        )
        control = ControlFile(directory, no_sync=no_sync)
        control.write(state)
        if not no_sync:
            # The new directories' own entries: without these a crash could lose the whole
            # timeline, votes included, though its control file was fsynced.
            fsync_dir(directory.parent)
            fsync_dir(directory.parent.parent)
        return cls(
            directory, Acceptor(node_id, state, INVALID_LSN), storage, no_sync=no_sync,
            wal_io_engine=wal_io_engine, control=control,
        )

    # -- the write path ----------------------------------------------------------------------

    async def process_batch(
        self, batch: Sequence[ProposerMessage]
    ) -> tuple[list[AcceptorMessage], Exception | None]:
        """Process proposer messages in order; appends share one write and one flush.

        Returns the replies to send, in order (one AppendResponse for each run of appends)
        and the error that stopped the batch, if one did: messages before it are fully
        processed and their WAL flushed.
        """
        replies: list[AcceptorMessage] = []
        # The group's WAL: contiguous chunks from ``begin`` (the acceptor checked each).
        begin = INVALID_LSN
        writes: list[bytes | memoryview] = []
        appended = False
        error: Exception | None = None
        acceptor = self.acceptor
        async with self.lock:
            try:
                for msg in batch:
                    self.stats.messages += msg.messages if type(msg) is AppendRequest else 1
                    if isinstance(msg, AppendRequest):
                        if self.storage.broken is not None:
                            # Before the acceptor: the refusal names the real cause.
                            self.storage.check_usable()
                        refusal = acceptor.append(msg)
                        if refusal is not None:
                            replies.append(refusal)
                            continue
                        appended = True
                        if msg.end_lsn > msg.begin_lsn:
                            if not writes:
                                begin = msg.begin_lsn
                            writes.append(msg.wal)
                        continue
                    if writes:
                        # Emptied first: if the write raises InvalidWal (its valid prefix
                        # is on disk), the group must not be written a second time below.
                        group, writes = writes, []
                        await self._write_group(begin, group)
                    if appended:
                        # Acknowledge the appends before answering what follows them.
                        acceptor.advance_commit()
                        replies.append(self._append_response())
                        appended = False
                    for effect in acceptor.process(msg):
                        if isinstance(effect, Reply):
                            replies.append(effect.msg)
                        elif isinstance(effect, WriteWal):
                            raise AssertionError("only AppendRequests write WAL")
                        else:
                            await self._apply(effect)
            except (AcceptorError, InvalidWal) as exc:
                error = exc
            if writes:
                try:
                    await self._write_group(begin, writes)
                except InvalidWal as exc:
                    error = error or exc
            if appended:
                # commit_lsn moves only over flushed WAL, so it is advanced after the write.
                acceptor.advance_commit()
                replies.append(self._append_response())
            await self._publish()
        return replies, error

    def _append_response(self) -> AppendResponse:
        resp = self.acceptor.append_response()
        if self.ps_feedback is not None:
            # The walproposer reads the pageserver's progress from here (Neon does the same).
            resp = attrs.evolve(resp, pageserver_feedback=self.ps_feedback)
        return resp

    async def _apply(self, effect: PersistControl | InitFirstSegment | TruncateWal) -> None:
        if isinstance(effect, PersistControl):
            await trio.to_thread.run_sync(self.control.write, effect.state)
            self.persisted = effect.state
        elif isinstance(effect, InitFirstSegment):
            await self.io.run(self.storage.init_first_segment, effect.lsn, effect.system_id)
        else:
            await self.io.run(self.storage.truncate, effect.lsn)

    async def _write_group(self, begin: Lsn, chunks: list[bytes | memoryview]) -> None:
        """Check, write and flush one group (the sequential path), all in the WAL IO engine."""
        storage = self.storage
        fsyncs_before = storage.fsync_count

        def write_and_flush() -> None:
            storage.write_group(begin, chunks)
            storage.flush()

        try:
            await self.io.run(write_and_flush)
        finally:
            # On invalid WAL the storage kept only the valid prefix; follow it.
            self.acceptor.write_lsn = storage.write_lsn
            self.acceptor.wal_flushed(storage.flush_record_lsn)
        self.stats.record_group(len(chunks), sum(len(c) for c in chunks))
        self.stats.fsyncs += storage.fsync_count - fsyncs_before

    # -- the pipelined write path ------------------------------------------------------------
    #
    # write_appends() submits group N+1 to the timeline's WAL IO engine without waiting
    # for it; there its records are checked (page headers, every CRC-32C: the native
    # tracker releases the GIL) and its bytes written, so with the writer-thread engine
    # both run while the ingest loop goes on receiving group N+2. A group with invalid WAL
    # writes its valid prefix and cuts WAL back to its last record; the groups submitted
    # behind it are refused by the storage, and finish() reports the error after the
    # acknowledgement of that prefix. sync(N)
    # waits for N's write, then runs N's fdatasync (fsync on) in a worker on its own
    # descriptor, overlapping later writes; finish(N) then publishes N's flush and builds its
    # AppendResponse. At most SYNCS_IN_FLIGHT groups are in flight per connection, and N's
    # reply leaves only after N's write (and, fsync on, N's fdatasync) returned. A
    # truncation in between (another proposer) is queued behind the writes in the engine
    # and bumps the storage epoch, and N's flush is then not published: the truncation has
    # set the LSNs itself.

    async def write_appends(
        self, batch: Sequence[AppendRequest], wal_bytes: int = 0
    ) -> tuple[list[AcceptorMessage], PendingFlush | None, Exception | None]:
        """Check a batch of AppendRequests and submit its write, without waiting for it or
        flushing. Returns term-only refusals, the pending flush (None if nothing was
        accepted) and the error that stopped the batch, if any. ``wal_bytes`` is carried
        by the pending flush (the caller's byte budget)."""
        replies: list[AcceptorMessage] = []
        begin = INVALID_LSN
        chunks: list[bytes | memoryview] = []
        accepted = False
        error: Exception | None = None
        acceptor = self.acceptor
        storage = self.storage
        async with self.lock:
            # Before the acceptor sees the appends: the refusal names the real cause.
            storage.check_usable()
            try:
                for msg in batch:
                    self.stats.messages += msg.messages
                    refusal = acceptor.append(msg)
                    if refusal is not None:
                        replies.append(refusal)
                        continue
                    accepted = True
                    if msg.end_lsn > msg.begin_lsn:
                        if not chunks:
                            begin = msg.begin_lsn
                        chunks.append(msg.wal)
            except AcceptorError as exc:
                error = exc
            if not accepted:
                return replies, None, error
            if not chunks:
                # Nothing to write (empty appends): published in order after earlier groups
                # (finish() takes the pending flushes in order).
                end = acceptor.write_lsn
                write = Job.completed(
                    Written(-1, 0, end, Lsn(min(storage.flush_record_lsn, end)), storage.epoch)
                )
                return replies, PendingFlush(write, end, wal_bytes), error
            size = sum(len(c) for c in chunks)
            self.stats.record_group(len(chunks), size)
            write = await self.io.submit(_write_and_open_sync, storage, begin, chunks)
            return replies, PendingFlush(write, Lsn(begin + size), wal_bytes), error

    async def sync(self, pending: PendingFlush) -> None:
        """Wait for a pending group's write, then run its fdatasync (run as its own task;
        with fsync off ``finish`` calls it itself, as there is nothing to overlap)."""
        pending.syncing = True
        fd = -1
        dir_changes = 0
        closed = False

        def sync_and_close() -> None:
            # close() in the worker too: closing a file can block on some filesystems
            # (NFS flushes on close), and the event loop's thread must not wait on it.
            nonlocal closed
            try:
                # A segment this group (or an earlier one) renamed into place: its name
                # must be durable before anything written in it is acknowledged.
                self.storage.sync_directory(dir_changes)
                if fd >= 0:
                    self.storage.fdatasync(fd)
            finally:
                if fd >= 0:
                    closed = True
                    os.close(fd)

        try:
            try:
                written = await pending.write.wait()
            except BaseException:
                # The write failed (the storage is broken now): the acceptor must not
                # believe in WAL beyond what was written.
                self.acceptor.write_lsn = Lsn(
                    min(self.acceptor.write_lsn, self.storage.write_lsn)
                )
                raise
            pending.written = written
            fd = written.fd
            dir_changes = written.dir_changes
            self.stats.fsyncs += written.fsyncs
            if fd >= 0 or self.storage.dir_sync_due(dir_changes):
                await trio.to_thread.run_sync(sync_and_close)
                self.stats.fsyncs += 1
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            if fd >= 0 and not closed:
                # Only when cancelled before the worker started: this read-only descriptor
                # never carried a write, so its close has nothing to flush.
                os.close(fd)
            pending.done.set()

    async def finish(self, pending: PendingFlush) -> AppendResponse:
        """Wait for a pending group's fdatasync, publish its flush, build its reply."""
        if self.no_sync and not pending.syncing:
            # Nobody started sync() (fsync off: no task per group): wait for the write here.
            try:
                await self.sync(pending)
            except Exception:
                pass  # in pending.error, raised below
        await pending.done.wait()
        if pending.error is not None:
            if isinstance(pending.error, WalStorageError):
                raise pending.error
            raise RuntimeError("fdatasync of a WAL write group failed") from pending.error
        # Once the storage is broken nothing more is acknowledged, not even a group whose own
        # fdatasync succeeded before a later group's write or fdatasync failed. That group's
        # bytes are durable (its fdatasync ran on a description opened after they were
        # written, and Linux reports any writeback error since then on it), so the restart
        # scan finds them and the proposer learns them at its next election: withholding the
        # ack costs one round trip. Sending it would mean publishing flush_lsn and commit_lsn
        # on a timeline whose file state we no longer vouch for; an ack withheld is never
        # unsafe, a wrong one is. This also keeps acks in group order trivially: a later
        # group is never acknowledged either.
        self.storage.check_usable()
        written = pending.written
        assert written is not None  # sync() ran and its write succeeded
        async with self.lock:
            # Published only in the group's epoch, checked under the storage's LSN lock: a
            # later group's invalid WAL may be cutting WAL back in the engine's thread now.
            # The one epoch decision for everything below.
            published = self.storage.mark_flushed(
                written.epoch, written.write_lsn, written.record_end
            )
            if written.error is not None:
                # WAL was cut back at the group's last valid record (or the group followed
                # such a cut): the acceptor must not believe in WAL past what is written.
                # Only in the epoch of the cut: an election since then truncated and set the
                # acceptor's LSNs itself, and a new proposer may already have WAL in flight
                # that this deposed group must not take back from it.
                if published:
                    self.acceptor.write_lsn = Lsn(
                        min(self.acceptor.write_lsn, self.storage.write_lsn)
                    )
                pending.invalid = written.error
            if published and written.record_end > self.acceptor.flush_record_lsn:
                self.acceptor.wal_flushed(written.record_end)
            self.acceptor.advance_commit()
            await self._publish()
            return self._append_response()

    async def _publish(self) -> None:
        acc = self.acceptor
        self.flush_lsn.value = acc.flush_lsn
        self.commit_lsn.value = acc.commit_lsn
        self.term.value = acc.term
        # commit_lsn is persisted lazily: every segment, and when it first reaches the
        # current term's start (what --sync-safekeepers waits for).
        persisted = self.persisted.commit_lsn
        seg = self.storage.seg_size
        if acc.commit_lsn >= persisted + seg or (
            acc.commit_lsn >= acc.term_start_lsn > persisted
        ):
            state = acc.persisted_state()
            await trio.to_thread.run_sync(self.control.write, state)
            self.persisted = state

    async def persist(self) -> None:
        """Save the in-memory LSNs (clean shutdown)."""
        async with self.lock:
            state = self.acceptor.persisted_state()
            if state != self.persisted:
                await trio.to_thread.run_sync(self.control.write, state)
                self.persisted = state

    # -- WAL removal -------------------------------------------------------------------------

    def removal_horizon(self) -> Lsn:
        """The lowest LSN a consumer may still need (see ``safekeeper.wal_removal``)."""
        acc = self.acceptor
        return removal_horizon(
            remote_consistent_lsn=acc.remote_consistent_lsn,
            peer_horizon_lsn=acc.peer_horizon_lsn,
            commit_lsn=acc.commit_lsn,
            flush_lsn=acc.flush_lsn,
            consumers=[r.needs_from for r in self.replicas.values()],
            backup_lsn=acc.backup_lsn if self.backup.enabled else None,
        )

    async def advance_backup(self, segno: int) -> None:
        """Segment ``segno`` is in remote storage: move ``backup_lsn`` to its end and save the
        control file (under the lock, as every control-file write), so a restart resumes
        after it. ``backup_lsn`` never moves back."""
        end = Lsn((segno + 1) * self.storage.seg_size)
        async with self.lock:
            if end <= self.acceptor.backup_lsn:
                return
            self.acceptor.backup_lsn = end
            state = self.acceptor.persisted_state()
            await trio.to_thread.run_sync(self.control.write, state)
            self.persisted = state

    async def remove_old_wal(self) -> int:
        """Delete the segments wholly below the removal horizon; returns how many."""
        seg = self.storage.seg_size
        async with self.lock:
            # Under the lock: no election or write moves the LSNs while we decide.
            cutoff = first_kept_segment(self.removal_horizon(), seg)
            if cutoff <= self.wal_removed_below:
                return 0
            # A restart scans for the end of WAL from the persisted commit_lsn, so that LSN
            # must not lie in a removed segment. The horizon is <= commit_lsn in memory.
            if self.persisted.commit_lsn < cutoff * seg:
                state = self.acceptor.persisted_state()
                await trio.to_thread.run_sync(self.control.write, state)
                self.persisted = state
            # Published first: a reader that loses the race gets 58P01, not a generic error.
            self.wal_removed_below = cutoff
            removed = await trio.to_thread.run_sync(self.storage.remove_segments_below, cutoff)
        return len(removed)

    def check_not_removed(self, lsn: Lsn) -> None:
        """PostgreSQL's answer to a request for WAL in a segment that is gone."""
        segno = lsn // self.storage.seg_size
        if segno < self.wal_removed_below or self.storage.segment_path(segno) is None:
            raise RemoteProtocolError(
                f"requested WAL segment {self.storage.segment_name(segno)} has already been "
                "removed",
                sqlstate="58P01",
            )

    # -- the read path -----------------------------------------------------------------------

    async def read_wal(self, lsn: Lsn, size: int) -> bytes:
        """Bytes of WAL at ``lsn`` (below flush_lsn), never crossing a segment end."""
        for _ in range(3):
            try:
                return await trio.to_thread.run_sync(self.storage.read, lsn, size)
            except FileNotFoundError:
                # The segment was renamed from .partial to its final name meanwhile.
                continue
            except WalStorageError:
                self.check_not_removed(lsn)
                raise
        try:
            return await trio.to_thread.run_sync(self.storage.read, lsn, size)
        except (FileNotFoundError, WalStorageError):
            self.check_not_removed(lsn)
            raise

    def status(self) -> dict[str, object]:
        acc = self.acceptor
        st = acc.state
        return {
            "tenant_id": st.tenant_id.hex,
            "timeline_id": st.timeline_id.hex,
            "term": st.term,
            "last_log_term": acc.last_log_term(),
            "term_history": [{"term": e.term, "lsn": f"{e.lsn >> 32:X}/{e.lsn & 0xFFFFFFFF:X}"} for e in st.term_history],
            "flush_lsn": _fmt(acc.flush_lsn),
            "write_lsn": _fmt(acc.write_lsn),
            "commit_lsn": _fmt(acc.commit_lsn),
            "timeline_start_lsn": _fmt(st.timeline_start_lsn),
            "local_start_lsn": _fmt(st.local_start_lsn),
            "peer_horizon_lsn": _fmt(acc.peer_horizon_lsn),
            "persisted_commit_lsn": _fmt(self.persisted.commit_lsn),
            "remote_consistent_lsn": _fmt(acc.remote_consistent_lsn),
            "backup_lsn": _fmt(acc.backup_lsn),
            "wal_backup": self.backup.as_dict(),
            "removal_horizon": _fmt(self.removal_horizon()),
            "wal_removed_below": _fmt(self.wal_removed_below * self.storage.seg_size),
            "pg_version": st.pg_version,
            "system_id": st.system_id,
            "wal_seg_size": st.wal_seg_size,
            "generation": st.mconf.generation,
            "push_connections": self.push_connections,
            "write_groups": self.stats.groups,
            "write_messages": self.stats.messages,
            # AppendRequests (or runs of them taken as one) in the write groups.
            "write_appends": self.stats.appends_in_groups,
            "write_bytes": self.stats.bytes,
            "fsyncs": self.stats.fsyncs,
            # The IO error that broke the WAL storage (None while it is usable).
            "wal_storage_broken": None if self.storage.broken is None else str(self.storage.broken),
            "replicas": [
                {
                    "name": r.name,
                    "sent_lsn": _fmt(r.sent_lsn),
                    "write_lsn": _fmt(r.write_lsn),
                    "flush_lsn": _fmt(r.flush_lsn),
                    "apply_lsn": _fmt(r.apply_lsn),
                    "hs_xmin": r.hs_xmin,
                }
                for r in self.replicas.values()
            ],
            "now": time.time(),
        }


def has_wal_segments(directory: Path) -> bool:
    """Whether ``directory`` holds a WAL segment file (complete or ``.partial``)."""
    for entry in os.listdir(directory):
        base = entry.removesuffix(".partial")
        if len(base) == 24 and all(c in "0123456789ABCDEF" for c in base):
            return True
    return False


def _write_and_open_sync(
    storage: WalStorage, begin: Lsn, chunks: Sequence[bytes | memoryview]
) -> Written:
    """A pipelined group's call in the WAL IO engine: check its records, write the valid
    bytes, then open the descriptor its fdatasync will use (opening, like closing, a file
    may block, so neither runs on the event loop's thread). Invalid WAL is a result, not an
    exception: the valid prefix is written, and whatever was written must still be synced
    and acknowledged before the error."""
    before = storage.fsync_count
    error: InvalidWal | None = None
    try:
        record_end = storage.write_group(begin, chunks).record_end
    except InvalidWal as exc:
        error = exc
        # write_group cut WAL back to the last valid record (flushed by the cut), or wrote
        # nothing of a group that followed a cut.
        record_end = Lsn(min(storage.flush_record_lsn, storage.write_lsn))
    fd = -1 if isinstance(error, FollowsInvalidWal) else storage.sync_handle()
    return Written(
        fd, storage.fsync_count - before, storage.write_lsn, Lsn(min(record_end, storage.write_lsn)),
        storage.epoch, error, storage.dir_changes,
    )


def _fmt(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
