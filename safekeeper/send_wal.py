"""Replication out of a safekeeper: ``START_REPLICATION`` as a PostgreSQL walsender does it.

Owns the streaming half of a replication connection. Receivers: ``pg_receivewal``, a
vanilla PostgreSQL 15 standby whose ``primary_conninfo`` points here, and the pageserver's
WAL receiver. Only committed WAL is sent (bytes below ``commit_lsn``), or with neon's
``(term='N')`` form, flushed WAL while the safekeeper's term is still N.

Two tasks per stream:
- the sender waits for ``commit_lsn`` to pass what it sent, reads the WAL and sends XLogData
  of at most 128 KiB that never crosses a segment end (and is cut back to a page boundary
  when more WAL is available, like the Neon safekeeper); after a second without new WAL it
  sends a keepalive asking for a reply;
- the receiver reads standby status updates and hot standby feedback and records them as the
  replica's LSNs (a ``pageserver*`` receiver's apply position, or Neon ``'z'`` feedback, is the
  pageserver's remote_consistent_lsn that WAL removal waits for). CopyDone (or EOF) from the
  client ends the stream.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import structlog
import trio

from common.pgcopy import CopyBothStream
from protocol.errors import INTERNAL_ERROR, RemoteProtocolError
from protocol.lsn import XLOG_BLCKSZ, Lsn, format_lsn
from protocol.replication import (
    HotStandbyFeedback,
    NeonFeedback,
    PrimaryKeepalive,
    StandbyStatusUpdate,
    XLogData,
    decode_client_copy_data,
    encode_copy_message,
    pg_now,
)
from safekeeper.timeline import ReplicaState, Timeline

log = structlog.get_logger("safekeeper.send_wal")

MAX_SEND_SIZE = 16 * XLOG_BLCKSZ
KEEPALIVE_INTERVAL_S = 1.0
_ids = itertools.count(1)


async def serve_replication(
    copy: CopyBothStream,
    timeline: Timeline,
    start_lsn: Lsn,
    *,
    name: str,
    term: int | None = None,
) -> None:
    """Stream WAL from ``start_lsn`` until the client ends the stream (or the term changes).

    Call ``check_start`` before entering COPY mode, so that a refusal is a plain error."""
    check_start(timeline, start_lsn, term)
    replica_id = next(_ids)
    # Registered with no checkpoint after check_start: WAL removal sees this receiver before
    # it could remove the start's segment.
    replica = ReplicaState(
        name=name, sent_lsn=start_lsn, last_reply=time.monotonic(), start_lsn=start_lsn
    )
    timeline.replicas[replica_id] = replica
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _receive_stage, copy, timeline, replica, nursery.cancel_scope.cancel
            )
            nursery.start_soon(_send_stage, copy, timeline, replica, start_lsn, term)
    finally:
        del timeline.replicas[replica_id]


async def _send_stage(
    copy: CopyBothStream, timeline: Timeline, replica: ReplicaState, start: Lsn, term: int | None
) -> None:
    value = timeline.commit_lsn if term is None else timeline.flush_lsn
    sent = start
    while True:
        if term is not None and timeline.term.value != term:
            log.info("term changed, ending the stream", term=term, now=timeline.term.value)
            return
        end = value.value
        if end <= sent:
            with trio.move_on_after(KEEPALIVE_INTERVAL_S):
                await value.wait_value(_greater_than(sent))
                continue
            await copy.send(encode_copy_message(PrimaryKeepalive(Lsn(end), pg_now(), True)))
            continue
        size = min(MAX_SEND_SIZE, end - sent)
        chunk_end = sent + size
        if chunk_end < end:
            # More is available: end this message on a page boundary if we can.
            rounded = chunk_end - chunk_end % XLOG_BLCKSZ
            if rounded > sent:
                size = rounded - sent
        data = await timeline.read_wal(sent, size)
        if not data:
            raise RemoteProtocolError(f"no WAL at {format_lsn(sent)}", sqlstate=INTERNAL_ERROR)
        msg = XLogData(sent, Lsn(end), pg_now(), data)
        await copy.send(msg.header() + data)
        sent = Lsn(sent + len(data))
        replica.sent_lsn = sent


def check_start(timeline: Timeline, start_lsn: Lsn, term: int | None) -> None:
    """PostgreSQL's refusals: a start beyond the WAL, or in a segment that is not here."""
    limit = (timeline.commit_lsn if term is None else timeline.flush_lsn).value
    if start_lsn > limit:
        raise RemoteProtocolError(
            f"requested starting point {format_lsn(start_lsn)} is ahead of the WAL flush "
            f"position of this server {format_lsn(limit)}",
            sqlstate=INTERNAL_ERROR,
        )
    if start_lsn < limit:
        timeline.check_not_removed(start_lsn)


def _greater_than(lsn: Lsn) -> Callable[[Lsn], bool]:
    return lambda v: v > lsn


async def _receive_stage(
    copy: CopyBothStream,
    timeline: Timeline,
    replica: ReplicaState,
    end_stream: Callable[[], None],
) -> None:
    is_pageserver = replica.name.startswith("pageserver")
    while True:
        payload = await copy.receive()
        if payload is None:
            end_stream()
            return
        msg = decode_client_copy_data(payload)
        replica.last_reply = time.monotonic()
        if isinstance(msg, StandbyStatusUpdate):
            replica.write_lsn = msg.write_lsn
            replica.flush_lsn = msg.flush_lsn
            replica.apply_lsn = msg.apply_lsn
            if is_pageserver:
                # pagestore's pageserver reports remote_consistent_lsn as its apply position.
                timeline.acceptor.pageserver_progress(msg.apply_lsn)
        elif isinstance(msg, HotStandbyFeedback):
            replica.hs_xmin = msg.xmin
            replica.hs_catalog_xmin = msg.catalog_xmin
        elif isinstance(msg, NeonFeedback):
            fb = msg.feedback
            timeline.ps_feedback = fb
            timeline.acceptor.pageserver_progress(fb.remote_consistent_lsn)
            replica.write_lsn = fb.last_received_lsn
            replica.flush_lsn = fb.disk_consistent_lsn
            replica.apply_lsn = fb.remote_consistent_lsn
