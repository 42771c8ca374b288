"""The pagestream sub-protocol once the connection is in CopyBoth: serial and pipelined.

``serve_pagestream(stream, decoder, ctx)`` runs until the client ends the stream and returns
how it ended (``StreamEnd``); a stream-ending failure raises (``RemoteProtocolError`` for a bad
message, ``StreamEndingError`` for Reconnect/Shutdown, trio's Broken/ClosedResourceError when
the client vanished). The caller (the libpq handler) turns that into an ErrorResponse.

Serial mode reads one request, answers it, repeats. It is the oracle of the pipelined mode: for
the same request bytes both must write the same response bytes (tests check it with
hypothesis over request sequences and TCP segmentations).

PIPELINED MODE (style.md §3.3, neon ``handle_pagerequests_pipelined``)

Three sibling tasks in one nursery:
- Reading owns the receive side: bytes -> request. A decode error is *sent downstream as a
  value* and Reading returns, so requests decoded before it are still answered.
- Batching resolves the timeline, computes the effective LSN (protocols.md §1.4) and folds
  into a ``FoldChannel``. Only GetPages fold; everything else (and every request already decided
  to fail) is a batch of one. A GetPage joins the pending batch only if the batch has room, is a
  GetPage batch of the same timeline, and the LSN rule holds: ``uniform-lsn`` needs the same
  effective LSN; ``scattered-lsn`` allows any mix except the same page at two different LSNs,
  so batching keeps working while WAL is ingested (neon#10765). A request that must wait for WAL
  never joins a batch of requests that need not wait: it would hold them back (neon#9379).
- Execution owns the send side: takes the pending batch the moment it is idle (no timer),
  waits once for the batch's highest LSN, does one vectored read, and writes all responses in
  request order with one ``send_all``.

HOPS: each hand-off between tasks costs a park, a wake and a run-loop iteration, which is what
unbatchable traffic would pay over serial mode. Two shortcuts keep the stages' roles while
skipping the hand-offs that have nothing to gain:
- FAST LANE: a lone request (nothing else buffered behind it) that finds Batching parked on
  an empty queue and Execution parked on an empty batch has nothing to be batched with and
  nothing to overlap with: Reading answers it itself (prepare, execute, one write), exactly
  what serial mode does, with no hand-off and no extra run-loop iteration. Everything before
  it is answered (Execution parks only between batches), so order holds. A request that must
  wait for WAL, or that ends the stream, still goes to Execution, so Reading keeps reading
  while it waits. The error semantics are the nursery's: an error raised in the lane tears
  the pipeline down like one raised by Execution.
- DIRECT FOLD: otherwise, while Batching is parked on an empty queue (it holds nothing),
  Reading runs Batching's step (prepare + fold) itself and wakes Execution directly; only a
  request the pending batch refuses, and what follows it, goes through Batching. Order is
  unchanged (nothing is queued or in Batching's hands), and Batching still does all the
  waiting (backpressure) whenever a batch is full or must not be joined.

ERROR PROPAGATION: per-request failures become pagestream Error responses. A stream-ending
failure travels as a ``Fatal`` item behind everything queued before it and is raised by
Execution once those are answered; raising cancels the other two stages, and the nursery's
exception group is unwrapped here, so callers see one plain exception.

CANCELLATION / CLEAN SHUTDOWN: only Reading ends the pipeline cleanly (EOF, Terminate or
CopyDone closes its channel, Batching drains and closes the fold channel, Execution answers the
last batch and returns). Shutdown of the server or timeline (``ctx.shutdown``) cancels the
pipeline from outside and raises ``Shutdown`` (57P01). The libpq idle timeout is a watcher
task too (``DirectStreamIO.enforce_idle_timeout``: no cancel scope per socket wait). Sends
are shielded from cancellation (bounded by ``send_timeout_s``), so a cancelled pipeline never
leaves half a response on the wire and the caller can still write its ErrorResponse.
"""

from __future__ import annotations

import math
import operator
import os
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol, TypeAlias, cast

import attrs
import trio

from common.pgserver import IdleTimeout
from common.tls_stream import TlsStream
from pageserver.page_service.config import (
    PageServiceConfig,
    PipelinedPipelining,
    SerialPipelining,
)
from pageserver.page_service.fold import FoldChannel, HandoffQueue, ReceiverGone
from pageserver.page_service.metrics import PageServiceMetrics
from pageserver.page_service.reader import (
    BadRequest,
    LsnTimeout,
    NotFound,
    PageRead,
    PageReader,
    PageRequestError,
    Reconnect,
    Shutdown,
    StreamEndingError,
    TimelineResolver,
)
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn, format_lsn
from protocol.pagestream import (
    BLCKSZ,
    MAX_REQUEST_MESSAGE_LEN,
    NEED_DATA,
    DbSizeRequest,
    ExistsRequest,
    GetPageRequest,
    GetSlruSegmentRequest,
    NblocksRequest,
    PagestreamVersion,
    RelTag,
    Request,
    RequestStreamDecoder,
    RequestTag,
    ResponseWriter,
    StreamEnd,
    _NeedData,
    decode_getpages,
    decode_request,
)

MAX_RECV: Final = 64 * 1024
MAX_FORKNUM: Final = 3  # init fork

REQUEST_TYPE: Final[dict[type, str]] = {
    ExistsRequest: "exists",
    NblocksRequest: "nblocks",
    GetPageRequest: "get_page",
    DbSizeRequest: "db_size",
    GetSlruSegmentRequest: "get_slru_segment",
}


@attrs.frozen
class PagestreamContext:
    """Everything one pagestream needs besides the stream itself."""

    version: PagestreamVersion
    resolver: TimelineResolver
    config: PageServiceConfig = attrs.field(factory=PageServiceConfig)
    metrics: PageServiceMetrics | None = None
    # Returns when the server or timeline starts shutting down; the stream then ends with 57P01.
    shutdown: Callable[[], Awaitable[object]] | None = None


class Pending:
    """A decoded request on its way to Execution.

    ``error`` is a per-request failure decided while batching (bad LSNs, relnode 0); such a
    request is answered with an Error response and never folds.

    A plain slots class, not attrs: one is made per request, and a frozen attrs class pays
    an ``object.__setattr__`` per field (and a Python call for ``foldable``'s default).
    Treated as immutable.
    """

    __slots__ = ("error", "foldable", "lsn", "needs_wait", "received_at", "request", "timeline")

    def __init__(
        self,
        request: Request,
        timeline: PageReader | None,
        lsn: Lsn,
        needs_wait: bool,
        error: PageRequestError | None,
        received_at: float,
    ) -> None:
        self.request = request
        self.timeline = timeline
        self.lsn = lsn
        self.needs_wait = needs_wait
        self.error = error
        self.received_at = received_at
        # Only a GetPage with no decided error joins a batch; decided once here rather than
        # on every fold (the batch's first request is looked at for each request folded in).
        self.foldable = error is None and type(request) is GetPageRequest

    def __repr__(self) -> str:
        return (
            f"Pending(request={self.request!r}, lsn={self.lsn:#x}, needs_wait={self.needs_wait}, "
            f"error={self.error!r})"
        )


@attrs.frozen
class Fatal:
    """A stream-ending failure, raised by Execution after everything before it is answered."""

    error: Exception


Item: TypeAlias = Pending | Fatal
# What Reading hands to Batching: every request already buffered when it looked, so a burst
# from a pipelining client crosses the channel (and gets folded) in one go instead of one
# task switch per request. A decode error can only be the last element; the first element
# may already be prepared (Reading folded the ones before it itself, see ``_read_stage``), and
# the GetPages of a connection's DirectStreamIO are prepared as they are read (a run at once,
# ``prepare_getpages``).
ReadEntry: TypeAlias = tuple[Request, float] | RemoteProtocolError | Pending | Fatal
ReadItem: TypeAlias = list[ReadEntry]
MAX_READ_BURST: Final = 128


class RequestSource(Protocol):
    """Where requests come from: the next request, or how the client ended the stream.

    Raises ``RemoteProtocolError`` for a message that cannot be decoded.
    """

    async def receive(self) -> Request | StreamEnd: ...

    def receive_nowait(self) -> Request | StreamEnd | None:
        """Like ``receive`` but only from what is already buffered; ``None`` if nothing is.

        (``None`` rather than ``trio.WouldBlock``: every burst of requests ends with this call,
        and raising costs more than the rest of the call.)
        """
        ...


class StreamRequestSource:
    """Requests straight from the byte stream (the framing is parsed by ``decoder``)."""

    __slots__ = ("decoder", "stream")

    def __init__(self, stream: trio.abc.ReceiveStream, decoder: RequestStreamDecoder) -> None:
        self.stream = stream
        self.decoder = decoder

    async def receive(self) -> Request | StreamEnd:
        decoder = self.decoder
        while True:
            event = decoder.next_event()
            if event is not NEED_DATA:
                return event
            decoder.receive_data(await self.stream.receive_some(MAX_RECV))

    def receive_nowait(self) -> Request | StreamEnd | None:
        event = self.decoder.next_event()
        return None if event is NEED_DATA else event


# Requests answered from already-received bytes before ``DirectStreamIO.receive`` yields to
# the scheduler once anyway: a client that keeps the socket full must not starve the other
# connections (or the shutdown watcher) of this single-threaded server.
YIELD_EVERY: Final = 32


class InFlight:
    """Requests read but not yet answered, for the idle timeout: a pipelined connection whose
    reader is parked on the socket while Execution waits for WAL or reads is not idle.

    Reading adds each burst to ``read``; Execution adds each answered batch to ``answered``
    and, when ``timed``, notes when (``answered_at``, trio's clock): with nothing in flight
    the connection has been idle since the later of that and the reader parking.
    """

    __slots__ = ("answered", "answered_at", "read", "timed")

    def __init__(self, timed: bool = False) -> None:
        self.read = 0
        self.answered = 0
        self.answered_at = -math.inf
        self.timed = timed


class DirectStreamIO:
    """Request source *and* response sink straight on the connection's byte stream.

    The libpq loop hands over its undecoded bytes (``initial``) and the stream after
    CopyBothResponse. A well-formed GetPage (the hot message: exact length, GetPage tag) is
    decoded with one ``struct`` call straight out of the receive buffer; every other message,
    and anything malformed, is handed whole to ``protocol.pagestream.RequestStreamDecoder``, so
    errors and edge cases are exactly that decoder's. On a TCP socket, reads and writes go to
    the file descriptor first and only park in trio (``wait_readable`` / ``wait_writable``) when
    the kernel has nothing to give or no room: a request that is already there costs no
    event-loop iteration. Other streams (memory streams in tests) use their own
    ``receive_some`` / ``send_all``.
    """

    __slots__ = (
        "_buf",
        "_decoder",
        "_drained",
        "_eof",
        "_fast",
        "_fd",
        "_idle_timeout_s",
        "_pos",
        "_ready",
        "_ready_at",
        "_rels",
        "_sock",
        "_tls",
        "_unyielded",
        "_v3",
        "_waiting_since",
        "in_flight",
        "park_when_drained",
        "stream",
    )

    def __init__(
        self,
        stream: trio.abc.Stream,
        version: PagestreamVersion,
        initial: bytes = b"",
        *,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.stream = stream
        # The libpq loop's idle timeout, kept while we read the socket instead of it.
        self._idle_timeout_s = math.inf if idle_timeout_s is None else idle_timeout_s
        self._decoder = RequestStreamDecoder(version)
        self._v3 = version == 3
        self._fast = _FRAMED_GETPAGE_V3 if self._v3 else _FRAMED_GETPAGE_V2
        self._buf = bytearray(initial)
        self._pos = 0
        self._eof = False
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._sock = sock
        # Over TLS the same: decrypt what is there and write what the socket takes without
        # an event-loop iteration (TlsStream's nowait paths), park only when it must.
        self._tls = stream if isinstance(stream, TlsStream) else None
        self._fd = sock.fileno() if sock is not None else -1
        self._unyielded = 0
        self._rels: dict[tuple[int, int, int, int], RelTag] = {}
        # GetPages decoded by the batch kernel and not yet returned (from ``_ready_at``)
        self._ready: list[GetPageRequest] = []
        self._ready_at = 0
        # trio.current_time() when the reader parked waiting for the client, else None; only
        # kept when there is an idle timeout (``enforce_idle_timeout`` reads it).
        self._waiting_since: float | None = None
        self.in_flight = InFlight(timed=self._idle_timeout_s != math.inf)
        # The last read returned less than asked: the kernel had nothing more at that moment.
        self._drained = False
        # Set by the pipelined mode's Reading: after a drained read whose requests are all
        # decoded, and nothing written since, park on the socket instead of first trying a
        # read that (the client waiting for answers Execution has not written yet) can only
        # fail with EAGAIN. A wrong guess costs one event-loop round, never correctness
        # (epoll is level-triggered). After a write (``write_nowait``) the next read is
        # tried first, in both modes: at queue depth 1 the client's next request is often
        # there by the time this task reads again.
        self.park_when_drained = False

    @property
    def idle_timeout_s(self) -> float:
        return self._idle_timeout_s

    async def receive(self) -> Request | StreamEnd:
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.checkpoint()  # before decoding: a cancel loses nothing
        while True:
            event = self._next_event()
            if event is not NEED_DATA:
                self._unyielded += 1
                return event
            # No cancel scope per wait for the idle timeout (entering and leaving one costs
            # more than decoding a request): ``enforce_idle_timeout`` watches ``_waiting_since``.
            timed = self._idle_timeout_s != math.inf
            tls = self._tls
            data: bytes | bytearray
            if tls is not None:
                # As on plaintext below: after a drained read, park before trying again.
                if self._drained and self.park_when_drained:
                    self._drained = False
                    await self._wait_tls(tls, timed)
                got = tls.receive_nowait(MAX_RECV)
                if got is None:
                    await self._wait_tls(tls, timed)
                    continue
                self._drained = tls.drained
                data = got
            elif self._sock is None:
                if timed:
                    self._waiting_since = trio.current_time()
                try:
                    data = await self.stream.receive_some(MAX_RECV)
                finally:
                    self._waiting_since = None
                self._unyielded = 0
            else:
                if self._drained and self.park_when_drained:
                    self._drained = False
                    await self._wait_readable(timed)
                try:
                    data = os.read(self._fd, MAX_RECV)
                except BlockingIOError:
                    await self._wait_readable(timed)
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(f"receiving from the client: {exc}") from exc
                self._drained = len(data) < MAX_RECV
            if data:
                self._buf += data
            else:
                self._eof = True

    async def _wait_tls(self, tls: TlsStream, timed: bool) -> None:
        if tls.unsent:
            await tls.flush()
        if timed:
            self._waiting_since = trio.current_time()
        try:
            await tls.wait_readable()
        finally:
            self._waiting_since = None
        self._unyielded = 0

    async def _wait_readable(self, timed: bool) -> None:
        assert self._sock is not None
        if timed:
            self._waiting_since = trio.current_time()
        try:
            await trio.lowlevel.wait_readable(self._sock)
        finally:
            self._waiting_since = None
        self._unyielded = 0

    async def enforce_idle_timeout(self) -> None:
        """Raise ``IdleTimeout`` once the connection has been idle for ``idle_timeout_s``:
        the reader waiting for the client *and* no request in flight (``in_flight``).

        Runs beside whoever calls ``receive`` (``serve_pagestream`` starts it); wakes about
        once per timeout period, so the per-request path pays only a clock read per wait
        (and, pipelined, one per batch).
        """
        idle, flight = self._idle_timeout_s, self.in_flight
        while True:
            since, now = self._waiting_since, trio.current_time()
            if since is None or flight.read != flight.answered:
                await trio.sleep_until(now + idle)
                continue
            since = max(since, flight.answered_at)
            if now - since >= idle:
                raise IdleTimeout(f"no message from the client for {idle} s")
            await trio.sleep_until(since + idle)

    def receive_nowait(self) -> Request | StreamEnd | None:
        if self._ready_at < len(self._ready):
            req = self._ready[self._ready_at]
            self._ready_at += 1
            return req
        if self._pos == len(self._buf) and not self._eof:
            return None  # how every burst ends: nothing buffered, nothing to decode
        event = self._next_event()
        return None if event is NEED_DATA else event

    def take_ready(self, head: GetPageRequest, limit: int) -> list[GetPageRequest]:
        """``head`` (the GetPage just returned) and up to ``limit - 1`` more that the batch
        kernel decoded with it: what ``receive_nowait`` would return next, in one call."""
        ready, at = self._ready, self._ready_at
        if at >= len(ready):
            return [head]
        end = min(len(ready), at + limit - 1)
        self._ready_at = end
        if at == 1 and end == len(ready) and ready[0] is head:
            return ready  # the whole run (the usual burst): no copy
        return [head, *ready[at:end]]

    def _next_event(self) -> Request | StreamEnd | _NeedData:
        if self._ready_at < len(self._ready):
            req = self._ready[self._ready_at]
            self._ready_at += 1
            return req
        buf, fast = self._buf, self._fast
        while True:
            pos = self._pos
            have = len(buf) - pos
            if have >= fast.size and buf[pos] == 0x64 and buf[pos + 5] == _GET_PAGE:
                # Every well-formed GetPage already received, decoded at once by the batch
                # kernel (exactly a GetPage: CopyData, exact length, GetPage tag); the first
                # message that is not one stays for the protocol decoder below. Relation
                # tags are reused (a compute reads few relations at a time).
                got: list[GetPageRequest]
                got, end = decode_getpages(
                    buf, pos, len(buf), self._v3, MAX_READ_BURST, GetPageRequest, RelTag,
                    self._rels,
                )
                if got:
                    self._consume(end - pos)
                    if len(got) > 1:
                        self._ready, self._ready_at = got, 1
                    return got[0]
            decoder = self._decoder
            if have >= 5:
                length = _U32.unpack_from(buf, pos + 1)[0]
                if 4 <= length <= MAX_REQUEST_MESSAGE_LEN and have < length + 1 and not self._eof:
                    return NEED_DATA
                # One whole message (or, if the framing is broken, everything there is):
                # the protocol decoder answers it or raises its error.
                take = length + 1 if 4 <= length <= MAX_REQUEST_MESSAGE_LEN else have
                take = min(take, have)
            elif self._eof:
                take = have
            else:
                return NEED_DATA
            if take:
                decoder.receive_data(bytes(buf[pos : pos + take]))
                self._consume(take)
            if self._eof and self._pos == len(buf):
                decoder.receive_data(b"")
            event = decoder.next_event()
            if event is NEED_DATA:
                if not take:
                    raise AssertionError("pagestream decoder wants data after end of stream")
                continue  # a message PostgreSQL ignores during COPY (Flush, Sync)
            return event

    def _consume(self, n: int) -> None:
        pos = self._pos + n
        if pos == len(self._buf):
            self._buf.clear()
            pos = 0
        elif pos >= COMPACT_AT:
            del self._buf[:pos]
            pos = 0
        self._pos = pos

    def write_nowait(self, data: bytes | bytearray | memoryview) -> memoryview | None:
        """Write what the socket takes now; the rest (``None`` when all went, or always the
        whole of ``data`` on a stream that is not a socket) is for ``send_all``."""
        view = memoryview(data)
        if self._tls is not None:
            # encrypted now; what the socket did not take waits in the stream (send_all flushes)
            self._drained = False  # try the next read before parking, as below
            return None if self._tls.send_nowait(view) else memoryview(b"")
        if self._sock is None:
            return view
        sent, n = 0, len(view)
        while sent < n:
            try:
                sent += os.write(self._fd, view[sent:])
            except BlockingIOError:
                return view[sent:]
            except OSError as exc:
                raise trio.BrokenResourceError(f"sending to the client: {exc}") from exc
        # The client may answer what we just wrote before this task reads again (queue depth
        # 1: the fast lane, serial mode): read before parking, as after a full read.
        self._drained = False
        return None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._tls is not None:
            if data:
                self._tls.send_nowait(data)
            await self._tls.flush()
            return
        if self._sock is None:
            await self.stream.send_all(data)
            return
        view: memoryview | None = memoryview(data)
        while view:
            view = self.write_nowait(view)
            if view is not None:
                await trio.lowlevel.wait_writable(self._sock)

    def take_unread(self) -> bytes:
        """Bytes received after the end of the stream (CopyDone): the libpq loop's again."""
        # (GetPages decoded but not served were read, as a pipelined burst is: they go too)
        self._ready, self._ready_at = [], 0
        rest = bytes(self._buf[self._pos :])
        self._buf.clear()
        self._pos = 0
        return rest


_GET_PAGE: Final = int(RequestTag.GET_PAGE)
# 'd', length, then the GetPage payload of protocols.md §1.2 (v3 has the reqid).
_FRAMED_GETPAGE_V3: Final = struct.Struct(">BIBQQQIIIBI")
_FRAMED_GETPAGE_V2: Final = struct.Struct(">BIBQQIIIBI")
_U32: Final = struct.Struct(">I")
COMPACT_AT: Final = 256 * 1024


class ByteSink(Protocol):
    """Where Execution writes framed responses (a ``trio.abc.SendStream`` or ``DirectStreamIO``)."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...


class CopyPayloads(Protocol):
    """The server loop's CopyBoth stream (``common.pgcopy.CopyBothStream``) as we use it."""

    @property
    def peer_done(self) -> bool: ...

    async def receive(self) -> bytes | None: ...

    def receive_nowait(self) -> bytes | None: ...


class CopyRequestSource:
    """Requests from CopyData payloads the libpq server loop already framed."""

    __slots__ = ("copy", "version")

    def __init__(self, copy: CopyPayloads, version: PagestreamVersion) -> None:
        self.copy = copy
        self.version = version

    async def receive(self) -> Request | StreamEnd:
        return self._event(await self.copy.receive())

    def receive_nowait(self) -> Request | StreamEnd | None:
        try:
            payload = self.copy.receive_nowait()
        except trio.WouldBlock:
            return None
        return self._event(payload)

    def _event(self, payload: bytes | None) -> Request | StreamEnd:
        if payload is None:
            return StreamEnd.COPY_DONE if self.copy.peer_done else StreamEnd.TERMINATE
        return decode_request(payload, self.version)


# ---------------------------------------------------------------------------------------------
# Preparing a request: timeline, effective LSN, early errors (shared by both modes)


def effective_lsn(request: Request, last_record_lsn: Lsn, gc_cutoff_lsn: Lsn) -> Lsn:
    """protocols.md §1.4: validate the two LSNs and pick the version to read."""
    lsn, nms = request.request_lsn, request.not_modified_since
    if lsn < nms:
        raise BadRequest(
            f"invalid request with request LSN {format_lsn(lsn)} and not_modified_since "
            f"{format_lsn(nms)}"
        )
    if lsn == 0:
        raise BadRequest("invalid LSN(0) in request")
    if lsn < gc_cutoff_lsn:
        raise BadRequest(
            f"tried to request a page version that was garbage collected. requested at "
            f"{format_lsn(lsn)} gc cutoff {format_lsn(gc_cutoff_lsn)}"
        )
    if nms > last_record_lsn:
        return nms
    return Lsn(min(last_record_lsn, lsn))


# A tuple, not ``A | B | C``: the union expression would build a new object per request.
_REL_REQUESTS: Final = (ExistsRequest, NblocksRequest, GetPageRequest)


def prepare(request: Request, received_at: float, resolver: TimelineResolver) -> Item:
    try:
        timeline = resolver.resolve(request)
    except NotFound as exc:
        # A GetPage for a timeline we do not have was misrouted: the compute must reconnect.
        if isinstance(request, GetPageRequest):
            return Fatal(Reconnect(f"reconnect: {exc}"))
        return Fatal(StreamEndingError(str(exc)))
    except StreamEndingError as exc:
        return Fatal(exc)
    try:
        if isinstance(request, _REL_REQUESTS):
            rel = request.rel
            if rel.relnode == 0:
                raise BadRequest(f"invalid relnode 0 in relation {rel}")
            if rel.forknum > MAX_FORKNUM:
                raise BadRequest(f"invalid fork number {rel.forknum} in relation {rel}")
        last = timeline.last_record_lsn
        lsn = effective_lsn(request, last, timeline.gc_cutoff_lsn)
    except PageRequestError as exc:
        return Pending(request, timeline, Lsn(0), False, exc, received_at)
    return Pending(request, timeline, lsn, lsn > last, None, received_at)


def prepare_getpages(
    requests: Sequence[GetPageRequest],
    received_at: float,
    resolver: TimelineResolver,
    out: list[ReadEntry],
) -> None:
    """``prepare`` of each of ``requests`` (GetPages read in one burst), appended to ``out``.

    The same items ``prepare`` makes one by one. When the resolver names the one reader of
    the connection (``constant``), the run is resolved and its timeline's LSNs read once, with
    no call per request; a request failing a check still goes through ``prepare``, so its
    error is worded the same. (Nothing can change the LSNs between the requests: no await.)
    """
    timeline: PageReader | None = getattr(resolver, "constant", None)
    if timeline is None:
        for r in requests:
            out.append(prepare(r, received_at, resolver))
        return
    last = timeline.last_record_lsn
    gc_cutoff = timeline.gc_cutoff_lsn
    append = out.append
    for r in requests:
        rel, lsn, nms = r.rel, r.request_lsn, r.not_modified_since
        if rel.relnode == 0 or rel.forknum > MAX_FORKNUM or lsn < nms or lsn == 0 or lsn < gc_cutoff:
            append(prepare(r, received_at, resolver))
        elif nms > last:
            append(Pending(r, timeline, nms, True, None, received_at))
        else:
            append(Pending(r, timeline, lsn if lsn < last else last, False, None, received_at))


def make_can_fold(cfg: PipelinedPipelining) -> Callable[[list[Item], Item], bool]:
    return make_folding(cfg)[0]


def make_folding(
    cfg: PipelinedPipelining,
) -> tuple[Callable[[list[Item], Item], bool], Callable[[list[Item], list[Item], int], int]]:
    """The ``FoldChannel``'s rule for one connection: ``can_fold(batch, item)`` and
    ``fold_run(batch, items, start)``, which appends to ``batch`` what ``can_fold`` would take
    of ``items[start:]`` one by one, checking a run of alike requests (the usual burst: one
    timeline, one LSN, none waiting) without a call per request."""
    max_batch_size = cfg.max_batch_size
    scattered = cfg.batching == "scattered-lsn"
    index = _LsnIndex()

    def can_fold(batch: list[Item], item: Item) -> bool:
        if len(batch) >= max_batch_size or type(item) is not Pending or not item.foldable:
            return False
        first = batch[0]
        if type(first) is not Pending or not first.foldable or item.timeline is not first.timeline:
            return False
        # A batch whose first request folds holds only requests that folded: Pendings.
        last: Pending = batch[-1]  # type: ignore[assignment]
        if item.needs_wait and not last.needs_wait:
            return False
        if not scattered:
            return item.lsn == last.lsn
        return index.allows(batch, item)  # type: ignore[arg-type]

    def fold_run(batch: list[Item], items: list[Item], start: int) -> int:
        i, n = start, len(items)
        first, last = batch[0], batch[-1]
        if (
            type(first) is Pending
            and first.foldable
            and type(last) is Pending
            # scattered-lsn: a batch all at one LSN takes any request at that LSN
            and (not scattered or index.uniform_lsn(batch) == last.lsn)  # type: ignore[arg-type]
        ):
            # exactly can_fold's checks for an item at the batch's (last) LSN
            timeline, lsn, waits = first.timeline, last.lsn, last.needs_wait
            stop = min(n, start + max_batch_size - len(batch))
            while i < stop:
                item = items[i]
                if (
                    type(item) is not Pending
                    or not item.foldable
                    or item.timeline is not timeline
                    or item.lsn != lsn
                    or (item.needs_wait and not waits)
                ):
                    break
                waits = item.needs_wait
                i += 1
            if i > start:
                batch += items[start:i]
        while i < n and can_fold(batch, items[i]):  # the rest, one by one
            batch.append(items[i])
            i += 1
        return i - start

    return can_fold, fold_run


class _LsnIndex:
    """The scattered-lsn rule (no page at two LSNs in one batch) without rescanning the batch.

    ``can_fold`` sees the same pending batch grow one item at a time until Execution takes it
    (then a new list). This remembers, for that list, whether all its LSNs are equal so far (the
    usual case: then any request at that LSN folds, nothing to look up) and, once they are
    not, its requests by block number. Work per fold is O(1) instead of O(batch). A batch is
    only ever appended to while pending; a different or shorter list starts over.
    """

    __slots__ = ("batch", "by_blkno", "indexed", "lsn", "seen", "uniform")

    def __init__(self) -> None:
        self.batch: list[Pending] | None = None
        self.lsn = Lsn(0)
        self.seen = 0  # batch[:seen] checked for uniformity
        self.uniform = True
        self.by_blkno: dict[int, list[Pending]] = {}
        self.indexed = 0  # batch[:indexed] are in by_blkno

    def uniform_lsn(self, batch: list[Pending]) -> Lsn | None:
        """The LSN of every request in ``batch``, None if they differ."""
        n = len(batch)
        if batch is not self.batch or n < self.seen:
            self.batch, self.lsn, self.seen, self.uniform = batch, batch[0].lsn, 1, True
            self.by_blkno, self.indexed = {}, 0
        if self.uniform:
            lsn = self.lsn
            for i in range(self.seen, n):
                if batch[i].lsn != lsn:
                    self.uniform = False
                    break
            self.seen = n
        return self.lsn if self.uniform else None

    def allows(self, batch: list[Pending], item: Pending) -> bool:
        n = len(batch)
        if self.uniform_lsn(batch) == item.lsn:
            return True
        by_blkno = self.by_blkno
        for i in range(self.indexed, n):
            p = batch[i]
            by_blkno.setdefault(cast(GetPageRequest, p.request).blkno, []).append(p)
        self.indexed = n
        req = cast(GetPageRequest, item.request)
        for other in by_blkno.get(req.blkno, ()):
            if other.lsn != item.lsn and cast(GetPageRequest, other.request).rel == req.rel:
                return False
        return True


# ---------------------------------------------------------------------------------------------
# Execution (shared by both modes)


def _lsn_timeout(lsn: Lsn, last_record_lsn: Lsn, timeout_s: float) -> LsnTimeout:
    # Worded here, not by the timeline, so a request's message names its own LSN whether it
    # waited alone (serial) or as part of a batch that waited for a higher one.
    return LsnTimeout(
        f"timed out after {timeout_s}s waiting for WAL up to {format_lsn(lsn)}; "
        f"last_record_lsn is {format_lsn(last_record_lsn)}"
    )


async def _wait_for(timeline: PageReader, lsn: Lsn, timeout_s: float) -> None:
    if lsn > timeline.last_record_lsn:
        try:
            await timeline.wait_lsn(lsn, timeout_s)
        except LsnTimeout:
            raise _lsn_timeout(lsn, timeline.last_record_lsn, timeout_s) from None


def _count(metrics: PageServiceMetrics | None, request: Request, ok: bool) -> None:
    if metrics is not None:
        metrics.count(REQUEST_TYPE[type(request)], ok)


async def execute_batch(
    batch: list[Pending], writer: ResponseWriter, ctx: PagestreamContext
) -> None:
    """Answer ``batch`` into ``writer``, in request order."""
    first = batch[0]
    if first.error is None and isinstance(first.request, GetPageRequest):
        if len(batch) == 1:  # every request at queue depth 1: no batch to set up
            assert first.timeline is not None
            await _execute_getpage(first, first.timeline, writer, ctx)
        else:
            await _execute_getpages(batch, writer, ctx)
        return
    if len(batch) != 1:
        raise AssertionError(f"only GetPage batches hold more than one request: {batch!r}")
    request, metrics = first.request, ctx.metrics
    try:
        if first.error is not None:
            raise first.error
        timeline = first.timeline
        assert timeline is not None
        await _wait_for(timeline, first.lsn, ctx.config.wait_lsn_timeout_s)
        match request:
            case ExistsRequest():
                writer.exists(request, await timeline.get_rel_exists(request.rel, first.lsn))
            case NblocksRequest():
                writer.nblocks(request, await timeline.get_rel_size(request.rel, first.lsn))
            case DbSizeRequest():
                writer.db_size(request, await timeline.get_db_size(request.dbnode, first.lsn))
            case GetSlruSegmentRequest():
                segment = await timeline.get_slru_segment(request.kind, request.segno, first.lsn)
                writer.slru_segment(request, segment)
            case GetPageRequest():  # only with a decided error, raised above
                raise AssertionError("unreachable")
    except PageRequestError as exc:
        writer.error(request, str(exc))
        _count(metrics, request, False)
    else:
        _count(metrics, request, True)


# (C loops over a batch: a generator step per request costs more than the step itself)
_lsn_of: Final[Callable[[Pending], Lsn]] = operator.attrgetter("lsn")
_request_of: Final[Callable[[Pending], GetPageRequest]] = operator.attrgetter("request")
_ALL_PAGES: Final = {bytes}


async def _execute_getpages(
    batch: list[Pending], writer: ResponseWriter, ctx: PagestreamContext
) -> None:
    timeline = batch[0].timeline
    assert timeline is not None
    timeout_s = ctx.config.wait_lsn_timeout_s
    top = max(map(_lsn_of, batch))
    results: Sequence[bytes | PageRequestError | None]
    try:
        await _wait_for(timeline, top, timeout_s)
    except PageRequestError as exc:
        results = await _read_after_failed_wait(batch, timeline, exc, timeout_s)
    else:
        into = getattr(timeline, "get_pages_into", None)
        got = None
        if into is not None and writer.framed and min(map(_lsn_of, batch)) == top:
            got = await _read_into_slots(batch, into, top, writer)
        if got is None:
            results = await _read_pages(
                timeline, [PageRead(p.request.rel, p.request.blkno, p.lsn) for p in batch]  # type: ignore[union-attr]
            )
        elif not got:
            if ctx.metrics is not None:
                ctx.metrics.count("get_page", True, len(batch))
            return  # the common batch: every page read into its response's slot
        else:
            results = got
    failed = 0
    if set(map(type, results)) == _ALL_PAGES:
        # the common batch: every page read; one kernel call frames all the answers
        writer.get_pages(list(map(_request_of, batch)), results)  # type: ignore[arg-type]
    else:
        for p, outcome in zip(batch, results, strict=True):
            request = cast(GetPageRequest, p.request)
            if isinstance(outcome, PageRequestError):
                writer.error(request, str(outcome))
                failed += 1
            elif outcome is None:
                raise AssertionError(f"no result for {request!r}")
            else:
                writer.get_page(request, outcome)
    if ctx.metrics is not None:
        if failed:
            ctx.metrics.count("get_page", False, failed)
        if failed < len(batch):
            ctx.metrics.count("get_page", True, len(batch) - failed)


async def _read_into_slots(
    batch: list[Pending], into: Callable[..., Awaitable[list[bytes | PageRequestError | None] | None]],
    lsn: Lsn, writer: ResponseWriter,
) -> list[bytes | PageRequestError] | None:
    """The batch's responses framed first with their pages left as slots, which the reader
    fills (``get_pages_into``: the image kernel reads each page straight into its response)
    and this fills with the pages the general path read. ``[]``: every response written.
    Otherwise the slots are taken back out (nothing written): None when the reader cannot take
    the batch this way, else every request's result for the per-request answers (an error,
    or a page that is not ``BLCKSZ`` bytes, which ``get_page`` refuses as before)."""
    requests = list(map(_request_of, batch))
    start, dest, stride = writer.reserve_pages(requests)
    try:
        placed = await into(requests, lsn, writer.buf, dest, stride)
    except PageRequestError as exc:
        placed = [exc] * len(batch)  # the walk itself failed: every read of it fails
    if placed is None:
        writer.truncate(start)
        return None
    if len(placed) != len(batch):
        raise AssertionError(f"get_pages_into returned {len(placed)} results for {len(batch)}")
    buf = writer.buf
    if placed.count(None) == len(placed):
        return []
    results: list[bytes | PageRequestError] = []
    whole = True
    at = dest
    for outcome in placed:
        if outcome is None:
            results.append(bytes(buf[at : at + BLCKSZ]))
        else:
            results.append(outcome)
            if type(outcome) is bytes and len(outcome) == BLCKSZ:
                buf[at : at + BLCKSZ] = outcome
            else:
                whole = False
        at += stride
    if whole:
        return []
    writer.truncate(start)
    return results


async def _execute_getpage(
    p: Pending, timeline: PageReader, writer: ResponseWriter, ctx: PagestreamContext
) -> None:
    """``_execute_getpages`` of a batch of one (every request at queue depth 1): the same
    wait, answer and counts, through ``PageReader.get_page`` and without the batch's lists."""
    request = cast(GetPageRequest, p.request)
    outcome: bytes | PageRequestError | None = None
    try:
        await _wait_for(timeline, p.lsn, ctx.config.wait_lsn_timeout_s)
    except PageRequestError as exc:
        # as _read_after_failed_wait: only a request whose LSN was not reached fails
        if p.lsn > timeline.last_record_lsn:
            outcome = exc
    if outcome is None:
        try:
            outcome = await timeline.get_page(PageRead(request.rel, request.blkno, p.lsn))
        except PageRequestError as exc:
            outcome = exc  # the walk itself failed
    ok = not isinstance(outcome, PageRequestError)
    if ok:
        writer.get_page(request, outcome)  # type: ignore[arg-type]
    else:
        writer.error(request, str(outcome))
    if ctx.metrics is not None:
        ctx.metrics.count("get_page", ok)


async def _read_pages(
    timeline: PageReader, reads: list[PageRead]
) -> Sequence[bytes | PageRequestError]:
    try:
        got = await timeline.get_pages(reads)
    except PageRequestError as exc:
        return [exc] * len(reads)  # the walk itself failed: every read of it fails
    if len(got) != len(reads):
        raise AssertionError(f"get_pages returned {len(got)} results for {len(reads)}")
    return got


async def _read_after_failed_wait(
    batch: list[Pending], timeline: PageReader, wait_error: PageRequestError, timeout_s: float
) -> list[bytes | PageRequestError | None]:
    # A failed wait fails only the requests whose LSN was not reached: a request that was
    # ready when it folded must not inherit a later request's timeout (serial would serve it).
    last = timeline.last_record_lsn
    results: list[bytes | PageRequestError | None] = [None] * len(batch)
    serve: list[int] = []
    for i, p in enumerate(batch):
        if p.lsn <= last:
            serve.append(i)
        else:
            results[i] = (
                _lsn_timeout(p.lsn, last, timeout_s)
                if isinstance(wait_error, LsnTimeout)
                else wait_error
            )
    if serve:
        reads = [
            PageRead(
                cast(GetPageRequest, batch[i].request).rel,
                cast(GetPageRequest, batch[i].request).blkno,
                batch[i].lsn,
            )
            for i in serve
        ]
        for i, got_one in zip(serve, await _read_pages(timeline, reads), strict=True):
            results[i] = got_one
    return results


async def _send(stream: ByteSink, data: bytearray, timeout_s: float) -> None:
    rest: bytes | bytearray | memoryview = data
    if isinstance(stream, DirectStreamIO):
        view = stream.write_nowait(data)
        if view is None:
            return  # the common case: the socket took it all, nothing to wait for
        rest = view
    # Shielded: a cancelled send_all leaves the stream mid-message, after which nobody could
    # write the ErrorResponse that tells the client why the stream ends.
    with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout_s) as scope:
        await stream.send_all(rest)
    if scope.cancelled_caught:
        raise trio.BrokenResourceError(f"client did not read {len(data)} bytes in {timeout_s}s")


# ---------------------------------------------------------------------------------------------
# Serial mode


async def _serve_serial(
    source: RequestSource, sink: ByteSink, ctx: PagestreamContext
) -> StreamEnd:
    writer = ResponseWriter(ctx.version)
    while True:
        event = await source.receive()
        if isinstance(event, StreamEnd):
            return event
        item = prepare(event, time.perf_counter(), ctx.resolver)
        if isinstance(item, Fatal):
            raise item.error
        taken = time.perf_counter()
        await execute_batch([item], writer, ctx)
        await _send(sink, writer.take(), ctx.config.send_timeout_s)
        _observe(ctx.metrics, [item], taken)


def _observe(metrics: PageServiceMetrics | None, batch: list[Pending], taken: float) -> None:
    if metrics is None:
        return
    done = time.perf_counter()
    if len(batch) == 1:  # every request at queue depth 1: the loop below for one
        p = batch[0]
        metrics.batch_size.observe(1)
        metrics.time_in_batcher_seconds.observe(taken - p.received_at)
        if type(p.request) is GetPageRequest:
            metrics.getpage_execution_seconds.observe(done - taken)
        return
    metrics.batch_size.observe(len(batch))
    getpages = 0
    # Requests read in one burst share ``received_at``: one observation per run of equal
    # values (with its count) rather than one per request.
    in_batcher = metrics.time_in_batcher_seconds
    run_at, run = batch[0].received_at, 0
    for p in batch:
        if p.received_at != run_at:
            in_batcher.observe(taken - run_at, run)
            run_at, run = p.received_at, 0
        run += 1
        if type(p.request) is GetPageRequest:
            getpages += 1
    in_batcher.observe(taken - run_at, run)
    if getpages:
        # Every GetPage of a batch waited for the same execution.
        metrics.getpage_execution_seconds.observe(done - taken, getpages)


# ---------------------------------------------------------------------------------------------
# Pipelined mode


@attrs.define
class _ReadState:
    end: StreamEnd | None = None


def _fold_directly(burst: ReadItem, batches: FoldChannel[Item], resolver: TimelineResolver) -> int:
    """Batching's step for the head of ``burst``, run by Reading while Batching is idle.

    Returns how many entries were folded; the first refused one is left in ``burst`` already
    prepared (so it is not prepared twice) and the rest, as they were, for Batching.
    """
    i, n = 0, len(burst)
    items = cast(list[Item], burst)  # fold_run takes only Pendings
    while i < n:
        entry = burst[i]
        if type(entry) is Pending:  # prepared as read: fold the run at once
            took = batches.send_run_nowait(items, i)
            if not took:
                return i
            i += took
            continue
        prepared = (
            Fatal(entry)
            if isinstance(entry, RemoteProtocolError)
            else prepare(entry[0], entry[1], resolver)
            if isinstance(entry, tuple)
            else entry
        )
        if not batches.send_nowait(prepared):
            burst[i] = prepared
            return i
        i += 1
    return n


class _Answerer:
    """Executes a batch and writes its responses in one send: Execution's step, and Reading's
    in the fast lane (never both at once: Reading takes the lane only while Execution is
    parked on an empty batch, and Execution gets nothing meanwhile)."""

    __slots__ = ("ctx", "flight", "sink", "timeout_s", "writer")

    def __init__(self, sink: ByteSink, ctx: PagestreamContext, flight: InFlight) -> None:
        self.sink = sink
        self.ctx = ctx
        self.flight = flight
        self.writer = ResponseWriter(ctx.version)
        self.timeout_s = ctx.config.send_timeout_s

    async def answer(self, batch: list[Pending]) -> None:
        taken = time.perf_counter()
        await execute_batch(batch, self.writer, self.ctx)
        await _send(self.sink, self.writer.take(), self.timeout_s)
        flight = self.flight
        flight.answered += len(batch)
        if flight.timed:
            flight.answered_at = trio.current_time()
        _observe(self.ctx.metrics, batch, taken)


async def _read_stage(
    source: RequestSource,
    out: HandoffQueue[ReadItem],
    batches: FoldChannel[Item],
    resolver: TimelineResolver,
    state: _ReadState,
    answerer: _Answerer,
) -> None:
    flight = answerer.flight
    # The connection's own decoder hands over each run of GetPages its kernel decoded at once,
    # prepared at once (``prepare_getpages``); other sources request by request.
    take_ready = source.take_ready if isinstance(source, DirectStreamIO) else None
    try:
        while True:
            burst: ReadItem = []
            event: Request | StreamEnd | None = None
            failed = False
            try:
                event = await source.receive()
                now = time.perf_counter()
                while event is not None and not isinstance(event, StreamEnd):
                    if take_ready is not None and type(event) is GetPageRequest:
                        run = take_ready(event, MAX_READ_BURST - len(burst))
                        prepare_getpages(run, now, resolver, burst)
                    else:
                        burst.append((event, now))
                    if len(burst) >= MAX_READ_BURST:
                        break
                    event = source.receive_nowait()
            except RemoteProtocolError as exc:
                burst.append(exc)  # answered after everything decoded before it
                failed = True
            if burst:
                flight.read += len(burst)
                if out.receiver_idle:
                    # FAST LANE: one request, nothing more buffered, Batching and Execution
                    # both parked with nothing in hand (everything before it is answered):
                    # there is nothing to batch it with and nobody to overlap with, so this
                    # task answers it itself, as serial mode does, instead of paying a
                    # hand-off and an event-loop iteration to wake Execution. A request that
                    # must wait for WAL, or a stream-ending one, still goes to Execution
                    # (Reading must stay free to read on while a request waits). The stages
                    # stay in one nursery: an error raised here tears the pipeline down
                    # exactly as one raised by Execution.
                    head = burst[0]
                    if (
                        len(burst) == 1
                        and (type(head) is tuple or type(head) is Pending)
                        and batches.receiver_idle
                    ):
                        item = prepare(head[0], head[1], resolver) if type(head) is tuple else head
                        if type(item) is Pending and not item.needs_wait:
                            await answerer.answer([item])
                            burst = []
                        else:
                            burst[0] = item
                    # Batching parked on an empty queue holds nothing, so doing its step
                    # here reorders nothing and saves the event-loop round (and the park and
                    # wake) of passing each request through it.
                    folded = _fold_directly(burst, batches, resolver) if burst else 0
                else:
                    folded = 0
                if folded < len(burst):
                    rest = burst[folded:] if folded else burst
                    # No schedule point when the queue has room: this task's next park
                    # (waiting for the socket) is one.
                    if not out.put_nowait(rest):
                        await out.put(rest)
            if failed:
                return
            if isinstance(event, StreamEnd):
                state.end = event
                return
    finally:
        out.close()  # tells Batching there is nothing more


async def _batch_stage(
    requests: HandoffQueue[ReadItem],
    batches: FoldChannel[Item],
    resolver: TimelineResolver,
) -> None:
    try:
        while True:
            try:
                burst = await requests.get()
            except trio.EndOfChannel:
                return
            items = cast(list[Item], burst)  # fold_run takes only Pendings
            i, n = 0, len(burst)
            while i < n:
                entry = burst[i]
                if type(entry) is Pending:  # prepared as read: fold the run at once
                    took = batches.send_run_nowait(items, i)
                    if took:
                        i += took
                        continue
                    prepared: Item = entry
                else:
                    prepared = (
                        prepare(entry[0], entry[1], resolver)
                        if isinstance(entry, tuple)
                        else Fatal(entry)
                        if isinstance(entry, RemoteProtocolError)
                        else entry
                    )
                # Fold without a task switch while the batch accepts; park only when not.
                if not batches.send_nowait(prepared):
                    await batches.send(prepared)
                i += 1
    finally:
        requests.close_receiver()
        batches.close()


async def _execute_stage(batches: FoldChannel[Item], answerer: _Answerer) -> None:
    try:
        while True:
            try:
                batch = await batches.receive()
            except trio.EndOfChannel:
                return
            first = batch[0]
            if isinstance(first, Fatal):
                raise first.error  # everything folded before it has been answered
            await answerer.answer(cast(list[Pending], batch))
    finally:
        batches.close_receiver()


async def _serve_pipelined(
    source: RequestSource,
    sink: ByteSink,
    ctx: PagestreamContext,
    cfg: PipelinedPipelining,
) -> StreamEnd:
    state = _ReadState()
    requests = HandoffQueue[ReadItem](ctx.config.read_queue)
    batches = FoldChannel[Item](*make_folding(cfg))
    if isinstance(source, DirectStreamIO):
        flight = source.in_flight
        source.park_when_drained = True
    else:
        flight = InFlight()
    answerer = _Answerer(sink, ctx, flight)
    async with _unwrapped(), trio.open_nursery() as nursery:
        nursery.start_soon(
            _read_stage,
            source,
            requests,
            batches,
            ctx.resolver,
            state,
            answerer,
            name="pagestream.read",
        )
        nursery.start_soon(
            _batch_stage, requests, batches, ctx.resolver, name="pagestream.batch"
        )
        nursery.start_soon(_execute_stage, batches, answerer, name="pagestream.execute")
    if state.end is None:
        raise AssertionError("pipeline finished without the reader seeing the end of the stream")
    return state.end


# ---------------------------------------------------------------------------------------------
# Entry point


async def serve_pagestream_bytes(
    stream: trio.abc.Stream, ctx: PagestreamContext, initial: bytes = b""
) -> StreamEnd:
    """``serve_pagestream`` over a raw byte stream (after CopyBothResponse was sent)."""
    io = DirectStreamIO(stream, ctx.version, initial)
    return await serve_pagestream(io, io, ctx)


async def serve_pagestream(
    source: RequestSource, sink: ByteSink, ctx: PagestreamContext
) -> StreamEnd:
    """Serve requests until the client ends the stream (see the module docstring).

    ``sink`` receives framed CopyData responses; this function is its only writer meanwhile.
    """
    mode = ctx.config.page_service_pipelining
    shutdown = ctx.shutdown
    watch_idle = (
        source.enforce_idle_timeout
        if isinstance(source, DirectStreamIO) and source.idle_timeout_s != math.inf
        else None
    )
    if shutdown is None and watch_idle is None:
        return await _serve_mode(source, sink, ctx, mode)
    pipeline = trio.CancelScope()
    result: StreamEnd | None = None

    async def watch_shutdown(shutdown: Callable[[], Awaitable[object]]) -> None:
        await shutdown()
        pipeline.cancel()

    async with _unwrapped(), trio.open_nursery() as nursery:
        if shutdown is not None:
            nursery.start_soon(watch_shutdown, shutdown, name="pagestream.shutdown")
        if watch_idle is not None:
            # Raises IdleTimeout, which cancels the pipeline (as the reader raising it would).
            nursery.start_soon(watch_idle, name="pagestream.idle")
        try:
            with pipeline:
                result = await _serve_mode(source, sink, ctx, mode)
        finally:
            nursery.cancel_scope.cancel()
    if result is None:
        # Only the shutdown watcher cancels ``pipeline``; anything else raised above.
        raise Shutdown()
    return result


async def _serve_mode(
    source: RequestSource,
    sink: ByteSink,
    ctx: PagestreamContext,
    mode: SerialPipelining | PipelinedPipelining,
) -> StreamEnd:
    if isinstance(mode, SerialPipelining):
        return await _serve_serial(source, sink, ctx)
    return await _serve_pipelined(source, sink, ctx, mode)


class _unwrapped:
    """Turn a nursery's exception group with one real error into that error.

    The pipeline is built so that one stage fails and the others are cancelled (or find their
    consumer gone: ``ReceiverGone``, which is never the cause); callers (and their ``except``
    clauses) should see that one failure, not a group. Groups of only ``Cancelled`` pass
    through untouched (trio's cancel scopes handle them).
    """

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> bool:
        if not isinstance(exc, BaseExceptionGroup):
            return False
        leaves = list(_leaves(exc))
        real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
        # A stage that found its consumer gone only reports that the consumer failed first
        # (e.g. Batching folding behind a Fatal that Execution just raised): not an error of
        # its own, and reporting it would turn the one real failure into a group.
        causes = [e for e in real if not isinstance(e, ReceiverGone)]
        if not causes and real:
            # Only consequences: the consumer was cancelled from outside. Re-raise the
            # cancellation so that its scope absorbs it, as if the producer had seen it too.
            cancelled: list[BaseException] = [e for e in leaves if isinstance(e, trio.Cancelled)]
            causes = cancelled[:1] or real[:1]
        if len(causes) == 1:
            raise causes[0]
        return False


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            out += _leaves(e)
        else:
            out.append(e)
    return out
