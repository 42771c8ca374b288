"""Replication out of a safekeeper: ``START_REPLICATION`` as a PostgreSQL walsender does it.

Owns the streaming half of a replication connection. Receivers: ``pg_receivewal``, a
vanilla PostgreSQL 15 standby whose ``primary_conninfo`` points here, and the pageserver's
WAL receiver. Only committed WAL is sent (bytes below ``commit_lsn``), or with neon's
``(term='N')`` form, flushed WAL while the safekeeper's term is still N: a term stream for
another term is refused, and one whose term moves on ends with an ErrorResponse (the
receiver must learn it; a stream that just stopped sending would hang it). Bytes read while
an election truncated the WAL (the storage epoch moved) are dropped, never sent.

Two tasks per stream:
- the sender waits for ``commit_lsn`` to pass what it sent, reads the WAL and sends XLogData
  of at most 128 KiB that never crosses a segment end (and is cut back to a page boundary
  when more WAL is available, like the Neon safekeeper); after a second without new WAL it
  sends a keepalive asking for a reply;
- the receiver reads standby status updates and hot standby feedback and records them as the
  replica's LSNs (a ``pageserver*`` receiver's apply position, or Neon ``'z'`` feedback, is the
  pageserver's remote_consistent_lsn that WAL removal waits for). CopyDone (or EOF) from the
  client ends the stream; so does ``RECEIVER_TIMEOUT_S`` without any reply (PostgreSQL's
  wal_sender_timeout: a dead receiver would otherwise hold back WAL removal). While WAL flows
  the sender asks for a reply once half of that has passed.
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
from protocol.safekeeper import PageserverFeedback
from safekeeper.timeline import ReplicaState, Timeline

log = structlog.get_logger("safekeeper.send_wal")

MAX_SEND_SIZE = 16 * XLOG_BLCKSZ
KEEPALIVE_INTERVAL_S = 1.0
# PostgreSQL's wal_sender_timeout: a receiver silent this long is dead (its host crashed, the
# network is partitioned). Without it a half-open connection keeps its replica registered,
# and its start pins the WAL removal horizon until TCP gives up, if it ever does.
RECEIVER_TIMEOUT_S = 60.0
_ids = itertools.count(1)


async def serve_replication(
    copy: CopyBothStream,
    timeline: Timeline,
    start_lsn: Lsn,
    *,
    name: str,
    term: int | None = None,
) -> None:
    """Stream WAL from ``start_lsn`` until the client ends the stream (or the term changes:
    then an error).

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
    storage = timeline.storage
    sent = start
    asked_at = -1.0
    while True:
        if term is not None:
            _check_term(timeline, term)
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
        epoch = storage.epoch
        data = await timeline.read_wal(sent, size)
        if storage.epoch != epoch:
            # A truncation (an election) ran while we read: the bytes may be zeros or another
            # term's WAL. Drop them and look again (a term stream then ends on the new term;
            # committed WAL is never truncated, so a plain stream just re-reads).
            continue
        if not data:
            raise RemoteProtocolError(f"no WAL at {format_lsn(sent)}", sqlstate=INTERNAL_ERROR)
        msg = XLogData(sent, Lsn(end), pg_now(), data)
        await copy.send(msg.header() + data)
        sent = Lsn(sent + len(data))
        replica.sent_lsn = sent
        if (
            time.monotonic() - replica.last_reply > RECEIVER_TIMEOUT_S / 2
            and asked_at != replica.last_reply
        ):
            # WAL keeps flowing, so no idle keepalive goes out: ask for a reply before the
            # timeout, as a walsender does (a standby may send none unless asked).
            asked_at = replica.last_reply
            await copy.send(encode_copy_message(PrimaryKeepalive(Lsn(end), pg_now(), True)))


def _check_term(timeline: Timeline, term: int) -> None:
    """A ``(term='N')`` stream serves term N's WAL only. The acceptor's term, not the published
    one: it changes before the election's truncation starts, the published one only after."""
    now = timeline.acceptor.term
    if now != term:
        log.info("term changed, ending the stream", term=term, now=now)
        raise RemoteProtocolError(
            f"term changed: streaming was requested for term {term}, this safekeeper is at "
            f"term {now}",
            sqlstate=INTERNAL_ERROR,
        )


def check_start(timeline: Timeline, start_lsn: Lsn, term: int | None) -> None:
    """PostgreSQL's refusals: a start beyond the WAL, or in a segment that is not here; and
    neon's: a term stream for a term that is not the current one."""
    if term is not None:
        _check_term(timeline, term)
    # The flushed WAL, also for a committed-only stream: commit_lsn is persisted lazily, so
    # after a crash it restarts up to a segment lower than what receivers were already sent.
    # A receiver may hold WAL up to any LSN that was committed somewhere, which is never
    # truncated; it waits (with keepalives) until commit_lsn here passes its start.
    limit = timeline.acceptor.flush_lsn
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
        wait = replica.last_reply + RECEIVER_TIMEOUT_S - time.monotonic()
        with trio.move_on_after(max(wait, 0.0)) as timer:
            payload = await copy.receive()
        if timer.cancelled_caught:
            raise RemoteProtocolError(
                f"terminating the WAL sender due to replication timeout: no reply from "
                f"{replica.name!r} for {RECEIVER_TIMEOUT_S:g} s",
                sqlstate="08006",  # connection_failure
            )
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
                # ... and that is its feedback for the walproposer (AppendResponse), as Neon's
                # 'z' message would be: whichever pageserver streams the timeline now.
                timeline.ps_feedback = PageserverFeedback(
                    last_received_lsn=msg.write_lsn, disk_consistent_lsn=msg.flush_lsn,
                    remote_consistent_lsn=msg.apply_lsn, replytime=msg.timestamp)
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
