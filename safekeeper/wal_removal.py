"""WAL removal: which old segment files no consumer can need any more, and the periodic task.

Owns the removal rule. The horizon is the lowest LSN anyone may still ask for:

    min(remote_consistent_lsn   the pageserver's durable position (its feedback): WAL above it
                                exists only on the pageserver's disk and here,
        backup_lsn              with WAL backup on (``remote_storage`` set): WAL below it is in
                                remote storage as whole segments (``safekeeper.wal_backup``),
        peer_horizon_lsn        the proposer's truncate_lsn: what every safekeeper has,
        each live replication consumer's flush position (its start until it reports one),
        commit_lsn, flush_lsn)  never past what this node has committed and flushed

It is Neon's ``get_horizon_segno`` with the live consumers added. Without remote storage there
is no backup and the ``backup_lsn`` term is left out (it would hold everything forever); the
pageserver then cannot read removed WAL back from anywhere, which is what the term is for. A
segment is removed only when every one of its bytes is below the horizon, so the segment
holding the horizon stays, and so does every segment above it (the open one included).

The periodic task (one per timeline, ``wal_removal_period_s``, 0 = off) calls
``Timeline.remove_old_wal``; a filesystem error is logged and retried on the next period.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog
import trio

from protocol.lsn import Lsn

if TYPE_CHECKING:
    from safekeeper.timeline import Timeline

log = structlog.get_logger("safekeeper.wal_removal")


def removal_horizon(
    *,
    remote_consistent_lsn: Lsn,
    peer_horizon_lsn: Lsn,
    commit_lsn: Lsn,
    flush_lsn: Lsn,
    consumers: Iterable[Lsn] = (),
    backup_lsn: Lsn | None = None,
) -> Lsn:
    """The lowest LSN any consumer may still need (0 until a pageserver has reported).
    ``backup_lsn`` None: no WAL backup on this node (the term is left out)."""
    backup = () if backup_lsn is None else (backup_lsn,)
    return Lsn(min(remote_consistent_lsn, peer_horizon_lsn, commit_lsn, flush_lsn, *backup, *consumers))


def first_kept_segment(horizon: Lsn, seg_size: int) -> int:
    """The segment holding ``horizon``: it and every later segment stay."""
    return horizon // seg_size


def segments_to_remove(existing: Iterable[int], horizon: Lsn, seg_size: int) -> list[int]:
    """The segment numbers among ``existing`` whose bytes are all below ``horizon``."""
    keep = first_kept_segment(horizon, seg_size)
    return sorted(s for s in existing if s < keep)


async def run_wal_removal(timeline: Timeline, period_s: float) -> None:
    """Every ``period_s`` seconds, remove what ``timeline`` no longer needs (runs forever)."""
    while True:
        await trio.sleep(period_s)
        try:
            removed = await timeline.remove_old_wal()
        except OSError as exc:
            log.warning("WAL removal failed; retrying next period", error=str(exc))
            continue
        if removed:
            log.info(
                "removed old WAL segments",
                tenant_id=timeline.tenant_id.hex,
                timeline_id=timeline.timeline_id.hex,
                segments=removed,
            )
