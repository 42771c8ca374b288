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
- Both live in one nursery: an error in either cancels the other and ends the connection;
  WAL already flushed stays. CopyDone or EOF from the proposer ends the reader; the writer
  drains the channel and returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import attrs
import structlog
import trio

from common.pgcopy import CopyBothStream
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

log = structlog.get_logger("safekeeper.receive_wal")

Item = ProposerMessage | RemoteProtocolError
GetTimeline = Callable[[TenantId, TimelineId, bool], Awaitable[Timeline | None]]


@attrs.frozen
class IngestConfig:
    ingest_queue: int = 4096
    max_write_bytes: int = 1 << 20


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error of a pipeline (the other task only saw the cancellation)."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for e in exc.exceptions:
                walk(e)
        else:
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


async def serve_wal_push(
    copy: CopyBothStream,
    version: ProtocolVersion,
    ids: tuple[TenantId, TimelineId],
    get_timeline: GetTimeline,
    allow_timeline_creation: bool,
    cfg: IngestConfig,
) -> None:
    """Run the proposer protocol on ``copy`` until the proposer stops or an error ends it.

    ``ids`` are the tenant and timeline of the connection's startup options; the greeting
    must name the same."""
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
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_stage, copy, send, version, name="wal_push.read")
                nursery.start_soon(
                    _write_stage, copy, receive, timeline, version, cfg.max_write_bytes,
                    name="wal_push.write",
                )
        except BaseExceptionGroup as group:
            raise _single(group) from None
    finally:
        timeline.push_connections -= 1


async def _read_stage(
    copy: CopyBothStream, out: trio.MemorySendChannel[Item], version: ProtocolVersion
) -> None:
    async with out:
        while True:
            payload = await copy.receive()
            # Then everything already buffered, without a checkpoint per message: a trio
            # scheduling round per 1 KiB message would cost more than the message.
            while payload is not None:
                try:
                    item: Item = decode_proposer_message(payload, version)
                except RemoteProtocolError as exc:
                    item = exc
                try:
                    out.send_nowait(item)
                except trio.WouldBlock:
                    await out.send(item)
                if isinstance(item, RemoteProtocolError):
                    return
                try:
                    payload = copy.receive_nowait()
                except trio.WouldBlock:
                    break
            else:
                return


async def _write_stage(
    copy: CopyBothStream,
    messages: trio.MemoryReceiveChannel[Item],
    timeline: Timeline,
    version: ProtocolVersion,
    max_write_bytes: int,
) -> None:
    # With coalescing and fsync on, group N's fdatasync runs while group N+1 is checked and
    # written (Timeline.write_appends/sync/finish); N's AppendResponse still leaves only
    # after N's fdatasync, and before anything about N+1.
    pipelined = max_write_bytes > 0 and not timeline.no_sync
    pending: PendingFlush | None = None

    async def send(replies: Iterable[AcceptorMessage]) -> None:
        payloads = [encode_message(r, version) for r in replies]
        if payloads:
            await copy.send_many(payloads)

    async def finish_pending() -> None:
        nonlocal pending
        if pending is not None:
            done, pending = pending, None
            await send([await timeline.finish(done)])

    async with messages, trio.open_nursery() as syncs:
        while True:
            try:
                if pending is not None:
                    try:
                        first = messages.receive_nowait()
                    except trio.WouldBlock:
                        # Nothing to overlap with: acknowledge the pending group first.
                        await finish_pending()
                        continue
                else:
                    first = await messages.receive()
            except trio.EndOfChannel:
                await finish_pending()
                return
            batch, stop = _collect(first, messages, max_write_bytes)
            if pipelined and batch and all(isinstance(m, AppendRequest) for m in batch):
                appends = [m for m in batch if isinstance(m, AppendRequest)]
                replies, new_pending, error = await timeline.write_appends(appends)
                await finish_pending()
                await send(replies)
                if new_pending is not None:
                    pending = new_pending
                    syncs.start_soon(timeline.sync, new_pending, name="wal_push.sync")
                if error is not None:
                    await finish_pending()
                    raise error
            elif batch:
                await finish_pending()
                replies, error = await timeline.process_batch(batch)
                await send(replies)
                if error is not None:
                    raise error
            if stop is not None:
                await finish_pending()
                raise stop


def _collect(
    first: Item, messages: trio.MemoryReceiveChannel[Item], max_write_bytes: int
) -> tuple[list[ProposerMessage], RemoteProtocolError | None]:
    """The write group that starts with ``first``: AppendRequests already queued, up to
    ``max_write_bytes`` of WAL; a non-append message ends it (it is the group's last)."""
    if isinstance(first, RemoteProtocolError):
        return [], first
    batch: list[ProposerMessage] = [first]
    if max_write_bytes > 0 and isinstance(first, AppendRequest):
        size = len(first.wal)
        while size < max_write_bytes:
            try:
                item = messages.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if isinstance(item, RemoteProtocolError):
                return batch, item
            batch.append(item)
            if not isinstance(item, AppendRequest):
                break
            size += len(item.wal)
    return batch, None
