"""WAL backup: the elected safekeeper of a timeline uploads its closed WAL segments.

Owns the election rule, the per-timeline backup task and its counters. Objects and names are
``remote_storage.wal_layout``'s (one PostgreSQL segment file per object, named by segment).

**What is uploaded.** A segment is *closed* once every byte of it is below this node's
``commit_lsn``: committed WAL is never truncated and is the same on every safekeeper, so the
object is the same whoever uploads it. Segments go up in order, one at a time, from the
segment holding ``backup_lsn``; after each one ``backup_lsn`` moves to that segment's end and
the control file is saved. ``backup_lsn`` starts at the timeline's start (nothing below it
exists). The open segment (and the one holding ``commit_lsn``) stays on the safekeepers only.

**Resuming.** Upload, then advance ``backup_lsn``, then save it: a crash between two leaves
``backup_lsn`` one segment short, never past a segment that is not in the store. At every
round the task first *adopts* the segments the store already has from ``backup_lsn`` on (a
peer uploaded them, or this node did before a crash): one ranged GET of the next name each,
and no upload of a segment that is already there. An interrupted PUT leaves no object (S3 PUTs
are atomic; the local kind writes a temp file and renames it), so the next round uploads that
segment again under the same name: no gaps, no second copy.

**Election.** Every safekeeper computes the same order without talking to the others: the ids
of ``wal_backup_peers`` sorted, rotated to start at ``timeline_id mod n``. The first in that
order (rank 0) is the elected uploader: it uploads every closed segment. A node of rank r > 0
also uploads once the store is ``r * wal_backup_takeover_bytes`` of closed WAL behind its own
``commit_lsn``: when the elected one is down or stuck the next one keeps the backup within
that lag, and stops again as soon as the elected one catches up (the adoption above makes the
hand-over in either direction free of duplicates). Non-uploading nodes adopt what the
uploader stored, so their own ``backup_lsn`` (and so their WAL removal) follows it. A node
whose WAL starts above the segment's (``local_start_lsn`` above both the segment start and the
timeline start: a node that joined later) cannot upload it and waits for another one to.

**Store down.** A failed upload is retried with capped exponential backoff (``failures`` and
``last_error`` in the status and metrics) and nothing moves meanwhile: ``backup_lsn`` stays,
so WAL removal keeps every segment above it. When the store answers again the task uploads
the backlog in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import structlog
import trio

from protocol.ids import TimelineId
from protocol.lsn import Lsn, format_lsn
from remote_storage import RemoteNotFoundError, RemoteStorage, RemoteStorageError
from remote_storage.retry import backoff_delay
from remote_storage.wal_layout import wal_segment_key

if TYPE_CHECKING:
    from safekeeper.timeline import Timeline

log = structlog.get_logger("safekeeper.wal_backup")

MAX_RETRY_DELAY_S = 5.0


@attrs.frozen
class BackupSettings:
    node_id: int
    peers: tuple[int, ...]
    period_s: float
    takeover_bytes: int


@attrs.define
class BackupStatus:
    """One timeline's backup progress on this node (status JSON and metrics)."""

    enabled: bool = False
    rank: int = 0
    uploading: bool = False  # the last round uploaded (or tried to)
    uploaded_segments: int = 0
    uploaded_bytes: int = 0
    adopted_segments: int = 0  # found already in the store (a peer's, or ours before a crash)
    failures: int = 0  # failed remote requests (each retried)
    last_error: str | None = None
    waiting_for: str | None = None  # why this node cannot upload the next segment, if it cannot

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def backup_order(peers: tuple[int, ...], node_id: int, timeline_id: TimelineId) -> list[int]:
    """The safekeeper ids in election order for ``timeline_id`` (the first is elected)."""
    ids = sorted({*peers, node_id})
    start = int.from_bytes(timeline_id.raw, "big") % len(ids)
    return ids[start:] + ids[:start]


def backup_rank(peers: tuple[int, ...], node_id: int, timeline_id: TimelineId) -> int:
    return backup_order(peers, node_id, timeline_id).index(node_id)


def closed_end(commit_lsn: Lsn, seg_size: int) -> Lsn:
    """The end of the last segment wholly below ``commit_lsn``."""
    return Lsn(commit_lsn // seg_size * seg_size)


def should_upload(rank: int, closed: Lsn, backup_lsn: Lsn, takeover_bytes: int) -> bool:
    """Whether a node of ``rank`` uploads the next segment now (see the module docstring)."""
    lag = closed - backup_lsn
    if lag <= 0:
        return False
    return rank == 0 or lag >= rank * takeover_bytes


async def _in_store(storage: RemoteStorage, key: str) -> bool:
    try:
        await storage.download(key, 0, 1)
    except RemoteNotFoundError:
        return False
    return True


async def backup_round(tl: Timeline, storage: RemoteStorage, settings: BackupSettings) -> int:
    """Adopt what the store has, then upload what this node should; returns segments uploaded.
    A failed upload is retried (with backoff) until it succeeds; a failed adoption probe
    raises (the caller logs it and tries again next round)."""
    status = tl.backup
    acc = tl.acceptor
    seg = tl.storage.seg_size
    if not acc.state.term_history:
        return 0  # no election yet: no WAL
    status.rank = backup_rank(settings.peers, settings.node_id, tl.timeline_id)
    while True:
        # (backup_lsn is not segment-aligned before the first segment: the timeline's start)
        segno = acc.backup_lsn // seg
        if (segno + 1) * seg > closed_end(acc.commit_lsn, seg):
            break
        if not await _in_store(storage, wal_segment_key(tl.tenant_id, tl.timeline_id, segno, seg)):
            break
        await tl.advance_backup(segno)
        status.adopted_segments += 1
    uploaded = 0
    status.uploading = False
    status.waiting_for = None
    while should_upload(status.rank, closed_end(acc.commit_lsn, seg), acc.backup_lsn,
                        settings.takeover_bytes):
        segno = acc.backup_lsn // seg
        if acc.state.local_start_lsn > max(segno * seg, acc.state.timeline_start_lsn):
            status.waiting_for = (
                f"segment {tl.storage.segment_name(segno)} starts below this node's WAL "
                f"(local_start_lsn {format_lsn(acc.state.local_start_lsn)}): a peer uploads it"
            )
            break
        path = tl.storage.segment_path(segno)
        if path is None:
            status.waiting_for = f"segment {tl.storage.segment_name(segno)} is not on this node"
            log.error("closed WAL segment missing; cannot back it up",
                      segment=tl.storage.segment_name(segno))
            break
        status.uploading = True
        key = wal_segment_key(tl.tenant_id, tl.timeline_id, segno, seg)
        size = await _upload_with_retries(storage, key, path, status)
        if size != seg:
            raise RuntimeError(f"uploaded {size} bytes of WAL segment {key}, expected {seg}")
        status.uploaded_segments += 1
        status.uploaded_bytes += size
        await tl.advance_backup(segno)
        uploaded += 1
        log.info("WAL segment backed up", key=key, backup_lsn=format_lsn(acc.backup_lsn))
    return uploaded


async def _upload_with_retries(storage: RemoteStorage, key: str, path: Path,
                               status: BackupStatus) -> int:
    attempt = 0
    while True:
        try:
            size = await storage.upload_file(key, path)
        except (RemoteStorageError, OSError) as exc:
            attempt += 1
            status.failures += 1
            status.last_error = f"uploading {key}: {exc}"
            level = log.info if attempt <= 3 else log.warning
            level("WAL segment upload failed, retrying", key=key, attempt=attempt, error=str(exc))
            await trio.sleep(backoff_delay(attempt, max_delay_s=MAX_RETRY_DELAY_S))
            continue
        status.last_error = None
        return size


async def run_wal_backup(tl: Timeline, storage: RemoteStorage, settings: BackupSettings) -> None:
    """Every ``period_s``, one ``backup_round`` (runs until cancelled)."""
    # Started from the connection that created the timeline: its log context (conn_id, peer)
    # is not this task's.
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(tenant_id=tl.tenant_id.hex, timeline_id=tl.timeline_id.hex)
    tl.backup.enabled = True
    attempt = 0
    while True:
        try:
            await backup_round(tl, storage, settings)
            attempt = 0
            delay = settings.period_s
        except (RemoteStorageError, OSError) as exc:
            attempt += 1
            tl.backup.failures += 1
            tl.backup.last_error = str(exc)
            log.warning("WAL backup round failed; retrying", error=str(exc), attempt=attempt)
            delay = max(settings.period_s, backoff_delay(attempt + 1, max_delay_s=MAX_RETRY_DELAY_S))
        await trio.sleep(delay)
