"""``START_WAL_PUSH``: one walproposer connection's ingest loop.

Shape (the design card's "drain memory channels into coalesced writes"):

    reader task ── decoded messages ──► bounded memory channel (ingest_queue) ──► writer task
                                                                 one write group, one flush,
                                                                 ONE AppendResponse per group

- The reader owns the receive side: CopyData payload -> proposer message. A decode error is
  sent down the channel *as a value* and the reader stops, so everything queued before it is
  still written and acknowledged before the ErrorResponse.
- The writer owns the send side. It awaits one message, then takes everything already
  queued with ``receive_nowait`` until ``max_write_bytes`` of WAL (or a non-append message)
  and hands the batch to ``Timeline.process_batch``: one ``pwritev`` per segment, one
  ``fdatasync``, one AppendResponse. ``max_write_bytes = 0`` turns coalescing off: one
  write + flush + reply per message.
- On a pgwire connection the reader does not see messages at all for the common case: it
  hands an ``AppendRunTaker`` to ``copy_receive_scan``, whose kernel frames the CopyData
  messages in the receive buffer, decodes their AppendRequest headers and copies each run of
  continuing appends' WAL into a reused buffer, one call per run (up to ``RUN_BYTES``):
  no object per message. Anything else (another message, a malformed one) comes back as a
  payload and is decoded as before.
- Both live in one nursery: an error in either cancels the other and ends the connection;
  WAL already flushed stays. CopyDone or EOF from the proposer ends the reader; the writer
  drains the channel and returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import attrs
import structlog
import trio

from common.pgcopy import CopyBothStream
from protocol.append_runs import AppendRunTaker, decode_append_run
from protocol.errors import INTERNAL_ERROR, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.safekeeper import (
    AcceptorMessage,
    AppendRequest,
    ProposerGreeting,
    ProposerMessage,
    ProtocolVersion,
    decode_proposer_message,
    encode_message,
)
from safekeeper.timeline import PendingFlush, Timeline
from safekeeper.wal_storage import WalStorageError

log = structlog.get_logger("safekeeper.receive_wal")

# fdatasyncs of consecutive write groups that may run at once (each group still answered
# only after its own, in order).
SYNCS_IN_FLIGHT = 2
# WAL of one run of continuing AppendRequests decoded as one request (never more than the
# connection's max_write_bytes): 128 messages of 1 KiB become one object and one copy.
APPEND_RUN_BYTES = 128 * 1024
# WAL of one run taken straight from the receive buffer (AppendRunTaker; never more than the
# connection's max_write_bytes): no per-message object, so a run may be a whole write group.
RUN_BYTES = 1 << 20

Item = ProposerMessage | RemoteProtocolError
GetTimeline = Callable[[TenantId, TimelineId, bool], Awaitable[Timeline | None]]
# A batch of CopyData payloads already received, as views of the receive buffer; None at
# the end of the stream (``PgConnection.copy_receive_views``).
ReceiveViews = Callable[[], Awaitable[list[memoryview] | None]]
# ``PgConnection.copy_receive_scan`` of the stream: the scanner runs over the receive buffer.
ReceiveScan = Callable[[AppendRunTaker], Awaitable[list[memoryview] | None]]


@attrs.frozen
class IngestConfig:
    ingest_queue: int = 4096
    max_write_bytes: int = 1 << 20
    # WAL bytes received but not yet written (queued or in the write in progress). Beyond
    # it the reader stops receiving and TCP pushes back on the proposer. With zero-copy
    # receive every queued AppendRequest pins its part of the receive buffer, so this bounds
    # the memory (4096 queued 128 KiB messages would be 512 MiB) and lets receive arrays be
    # reused instead of allocated.
    ingest_queue_bytes: int = 8 << 20


class _ByteBudget:
    """WAL bytes between the reader and the end of their write (see ``ingest_queue_bytes``).
    The reader adds, the writer releases once a batch is written; the reader waits while
    the total is above the limit (so one message beyond it is always let through)."""

    __slots__ = ("_below", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._below = trio.Event()

    async def wait_below(self) -> None:
        while self.used > self.limit:
            self._below = trio.Event()
            await self._below.wait()

    def release(self, n: int) -> None:
        self.used -= n
        if self.used <= self.limit:
            self._below.set()


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error of a pipeline (the other task only saw the cancellation). A broken
    WAL storage wins over anything else: with fdatasyncs in flight, the failed write and the
    sync refused because of it both report it, and the connection must end with its 58030,
    not with a group that the server would answer as a generic internal error."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for e in exc.exceptions:
                walk(e)
        else:
            leaves.append(exc)

    walk(group)
    if len(leaves) == 1:
        return leaves[0]
    for leaf in leaves:
        if isinstance(leaf, WalStorageError):
            return leaf
    return group


async def serve_wal_push(
    copy: CopyBothStream,
    version: ProtocolVersion,
    ids: tuple[TenantId, TimelineId],
    get_timeline: GetTimeline,
    allow_timeline_creation: bool,
    cfg: IngestConfig,
    receive_views: ReceiveViews | None = None,
    receive_scan: ReceiveScan | None = None,
) -> None:
    """Run the proposer protocol on ``copy`` until the proposer stops or an error ends it.

    ``ids`` are the tenant and timeline of the connection's startup options; the greeting
    must name the same. ``receive_views``, when given, is the zero-copy receive of the same
    stream: AppendRequests then carry views of the receive buffer all the way to ``pwritev``
    (the buffer never reuses memory under a live view). ``receive_scan``, when given, is
    the kernel receive of the same stream (see the module docstring); it is used for v3
    streams with coalescing on."""
    payload = await copy.receive()
    if payload is None:
        return
    first = decode_proposer_message(payload, version)
    if not isinstance(first, ProposerGreeting):
        raise RemoteProtocolError(
            f"the first message must be ProposerGreeting, got {type(first).__name__}",
            sqlstate=INTERNAL_ERROR,
        )
    if (first.tenant_id, first.timeline_id) != ids:
        raise RemoteProtocolError(
            f"greeting for {first.tenant_id}/{first.timeline_id} on a connection for "
            f"{ids[0]}/{ids[1]}",
            sqlstate=INTERNAL_ERROR,
        )
    timeline = await get_timeline(first.tenant_id, first.timeline_id, allow_timeline_creation)
    if timeline is None:
        log.info("timeline does not exist and may not be created", tenant_id=str(first.tenant_id))
        return
    timeline.push_connections += 1
    try:
        replies, error = await timeline.process_batch([first])
        await copy.send_many(encode_message(r, version) for r in replies)
        if error is not None:
            raise error
        send, receive = trio.open_memory_channel[Item](max(cfg.ingest_queue, 1))
        budget = _ByteBudget(cfg.ingest_queue_bytes)
        try:
            run_bytes = min(cfg.max_write_bytes, RUN_BYTES)
            async with trio.open_nursery() as nursery:
                if receive_scan is not None and version == 3 and run_bytes > 0:
                    nursery.start_soon(
                        _read_scan_stage, receive_scan, send, version, budget,
                        AppendRunTaker(run_bytes), name="wal_push.read",
                    )
                elif receive_views is None:
                    nursery.start_soon(
                        _read_stage, copy, send, version, budget, name="wal_push.read"
                    )
                else:
                    nursery.start_soon(
                        _read_views_stage, receive_views, send, version, budget,
                        min(cfg.max_write_bytes, APPEND_RUN_BYTES), name="wal_push.read",
                    )
                nursery.start_soon(
                    _write_stage, copy, receive, timeline, version, cfg.max_write_bytes, budget,
                    name="wal_push.write",
                )
        except BaseExceptionGroup as group:
            raise _single(group) from None
    finally:
        timeline.push_connections -= 1


async def _send_or_gone(out: trio.MemorySendChannel[Item], item: Item) -> bool:
    """Wait for room for ``item``. False once the write stage is gone: it closed its end
    because it failed, and its error is the connection's; the reader then ends quietly rather
    than raising a BrokenResourceError beside it (which would hide it from ``_single``)."""
    try:
        await out.send(item)
    except trio.BrokenResourceError:
        return False
    return True


async def _read_stage(
    copy: CopyBothStream,
    out: trio.MemorySendChannel[Item],
    version: ProtocolVersion,
    budget: _ByteBudget,
) -> None:
    with out:  # close() without aclose()'s checkpoint (see _write_stage)
        while True:
            if budget.used > budget.limit:
                await budget.wait_below()
            payload = await copy.receive()
            # Then everything already buffered, without a checkpoint per message: a trio
            # scheduling round per 1 KiB message would cost more than the message.
            while payload is not None:
                try:
                    item: Item = decode_proposer_message(payload, version)
                except RemoteProtocolError as exc:
                    item = exc
                if isinstance(item, AppendRequest):
                    budget.used += len(item.wal)
                try:
                    out.send_nowait(item)
                except trio.WouldBlock:
                    if not await _send_or_gone(out, item):
                        return
                except trio.BrokenResourceError:
                    return  # the write stage failed (see _send_or_gone)
                if isinstance(item, RemoteProtocolError):
                    return
                if budget.used > budget.limit:
                    break
                try:
                    payload = copy.receive_nowait()
                except trio.WouldBlock:
                    break
            else:
                return


async def _read_views_stage(
    receive_views: ReceiveViews,
    out: trio.MemorySendChannel[Item],
    version: ProtocolVersion,
    budget: _ByteBudget,
    run_bytes: int = 0,
) -> None:
    """``_read_stage`` on zero-copy batches: one await per batch of received messages. Runs
    of continuing v3 AppendRequests are decoded as one request each (``decode_append_run``:
    one kernel call and one copy of their WAL instead of an object per message), up to
    ``run_bytes`` of WAL (0: never, as without write coalescing, where every message is its
    own write)."""
    decode = decode_proposer_message
    with out:  # close() without aclose()'s checkpoint (see _write_stage)
        while True:
            if budget.used > budget.limit:
                await budget.wait_below()
            payloads = await receive_views()
            if payloads is None:
                return
            k = 0
            n = len(payloads)
            while k < n:
                run = (
                    decode_append_run(payloads, k, run_bytes)
                    if run_bytes and version == 3
                    else None
                )
                item: Item
                if run is not None:
                    item = run
                    k += run.messages
                else:
                    try:
                        item = decode(payloads[k], version)
                    except RemoteProtocolError as exc:
                        item = exc
                    k += 1
                if type(item) is AppendRequest:
                    budget.used += len(item.wal)
                try:
                    out.send_nowait(item)
                except trio.WouldBlock:
                    if not await _send_or_gone(out, item):
                        return
                except trio.BrokenResourceError:
                    return  # the write stage failed (see _send_or_gone)
                if isinstance(item, RemoteProtocolError):
                    return


async def _read_scan_stage(
    receive_scan: ReceiveScan,
    out: trio.MemorySendChannel[Item],
    version: ProtocolVersion,
    budget: _ByteBudget,
    taker: AppendRunTaker,
) -> None:
    """The reader on the receive kernel: one ``AppendRequest`` per run the taker copied out
    of the receive buffer; whatever it left (another message, or a malformed one, which the
    decoder then reports) is decoded on its own."""
    decode = decode_proposer_message
    with out:  # close() without aclose()'s checkpoint (see _write_stage)
        while True:
            if budget.used > budget.limit:
                await budget.wait_below()
            payloads = await receive_scan(taker)
            if payloads is None:
                return
            run = taker.take()
            items: list[Item] = []
            if run is not None:
                budget.used += len(run.wal)
                items.append(run)
            for payload in payloads:
                try:
                    item: Item = decode(payload, version)
                except RemoteProtocolError as exc:
                    item = exc
                if type(item) is AppendRequest:
                    budget.used += len(item.wal)
                items.append(item)
            for item in items:
                try:
                    out.send_nowait(item)
                except trio.WouldBlock:
                    if not await _send_or_gone(out, item):
                        return
                except trio.BrokenResourceError:
                    return  # the write stage failed (see _send_or_gone)
                if isinstance(item, RemoteProtocolError):
                    return


async def _write_stage(
    copy: CopyBothStream,
    messages: trio.MemoryReceiveChannel[Item],
    timeline: Timeline,
    version: ProtocolVersion,
    max_write_bytes: int,
    budget: _ByteBudget,
) -> None:
    # With coalescing on, group N's record checks and write (in the timeline's WAL IO
    # engine) and, fsync on, its fdatasync run while group N+1 is received and submitted
    # (Timeline.write_appends/sync/finish), and N+1's fdatasync starts as soon as N+1 is
    # written, even before N's has returned (at most SYNCS_IN_FLIGHT groups in flight).
    # Every AppendResponse still leaves only after its own group's write and fdatasync, in
    # group order.
    pipelined = max_write_bytes > 0
    pendings: deque[PendingFlush] = deque()

    async def send(replies: Iterable[AcceptorMessage]) -> None:
        payloads = [encode_message(r, version) for r in replies]
        if payloads:
            await copy.send_many(payloads)

    async def finish_oldest() -> None:
        pending = pendings.popleft()
        reply = await timeline.finish(pending)
        # Written: the receive memory of the group's messages is free.
        budget.release(pending.wal_bytes)
        await send([reply])
        if pending.invalid is not None:
            # The group's valid prefix is acknowledged; the groups behind it were refused
            # (never written, never acknowledged): the proposer's error ends the stream.
            raise pending.invalid

    async def finish_all() -> None:
        while pendings:
            await finish_oldest()

    # ``with``, not ``async with``: aclose() closes and then checkpoints, and closing wakes
    # the reader blocked in send() with BrokenResourceError, whose nursery cancellation then
    # hits that checkpoint and replaces the error in flight (a WalStorageBroken) with a
    # Cancelled the nursery absorbs: the connection would end as if the client went away.
    with messages:
        async with trio.open_nursery() as syncs:
            while True:
                try:
                    if pendings:
                        try:
                            first = messages.receive_nowait()
                        except trio.WouldBlock:
                            # Nothing queued: acknowledge the oldest pending group once it can
                            # be, unless the next message arrives first (then it is submitted
                            # while the oldest's write or fdatasync still runs).
                            item = await _next_or_ready(messages, pendings[0])
                            if item is None:
                                await finish_oldest()
                                continue
                            first = item
                    else:
                        first = await messages.receive()
                except trio.EndOfChannel:
                    await finish_all()
                    return
                batch, stop, appends, wal_bytes = _collect(first, messages, max_write_bytes)
                if pipelined and batch and len(appends) == len(batch):
                    replies, new_pending, error = await timeline.write_appends(appends, wal_bytes)
                    del batch, appends
                    if new_pending is None:
                        budget.release(wal_bytes)
                    if replies:
                        # Refusals of this batch follow the acknowledgements of earlier groups.
                        await finish_all()
                        await send(replies)
                    if new_pending is not None:
                        while len(pendings) >= SYNCS_IN_FLIGHT:
                            await finish_oldest()
                        pendings.append(new_pending)
                        if not timeline.no_sync:
                            # fsync off there is nothing to run beside the next group's write:
                            # finish() waits for the write itself (no task per group).
                            new_pending.syncing = True  # before the task runs: finish() must not
                            syncs.start_soon(timeline.sync, new_pending, name="wal_push.sync")
                    if error is not None:
                        await finish_all()
                        raise error
                elif batch:
                    await finish_all()
                    replies, error = await timeline.process_batch(batch)
                    del batch, appends
                    budget.release(wal_bytes)
                    await send(replies)
                    if error is not None:
                        raise error
                if stop is not None:
                    await finish_all()
                    raise stop


async def _next_or_ready(
    messages: trio.MemoryReceiveChannel[Item], oldest: PendingFlush
) -> Item | None:
    """The next message, or None as soon as ``oldest`` can be finished (its fdatasync, or
    with fsync off its write, returned) before one arrives. Raises ``EndOfChannel`` at the
    end of the stream. A receive cancelled here loses nothing (trio's channels)."""
    if oldest.done.is_set() if oldest.syncing else oldest.write.done:
        return None  # finishable already: no race to run
    got: list[Item] = []
    ended = False

    async def take(cancel: trio.CancelScope) -> None:
        nonlocal ended
        try:
            got.append(await messages.receive())
        except trio.EndOfChannel:
            ended = True
        cancel.cancel()

    async def ready(cancel: trio.CancelScope) -> None:
        if oldest.syncing:
            await oldest.done.wait()
        else:
            await oldest.write.finished()
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, nursery.cancel_scope)
        nursery.start_soon(ready, nursery.cancel_scope)
    if got:
        return got[0]
    if ended:
        raise trio.EndOfChannel
    return None


def _collect(
    first: Item, messages: trio.MemoryReceiveChannel[Item], max_write_bytes: int
) -> tuple[list[ProposerMessage], RemoteProtocolError | None, list[AppendRequest], int]:
    """The write group that starts with ``first``: AppendRequests already queued, up to
    ``max_write_bytes`` of WAL; a non-append message ends it (it is the group's last).
    Also returns the group's AppendRequests and their WAL size (for the byte budget)."""
    if isinstance(first, RemoteProtocolError):
        return [], first, [], 0
    batch: list[ProposerMessage] = [first]
    if type(first) is not AppendRequest:
        return batch, None, [], 0
    appends: list[AppendRequest] = [first]
    size = len(first.wal)
    if max_write_bytes > 0:
        while size < max_write_bytes:
            try:
                item = messages.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if type(item) is AppendRequest:
                batch.append(item)
                appends.append(item)
                size += len(item.wal)
                continue
            if isinstance(item, RemoteProtocolError):
                return batch, item, appends, size
            batch.append(item)
            break
    return batch, None, appends, size
