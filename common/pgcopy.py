"""``CopyBothStream``: the CopyData sub-stream of a libpq connection, server or client side.

After CopyBothResponse (or CopyOutResponse) both peers exchange raw ``CopyData`` payloads;
the sub-protocols (pagestream, safekeeper proposer/acceptor, physical replication) live in
those payloads. This class is the one API for that phase on both ends:

- ``await receive()`` -> the next payload, or ``None`` when the peer sent CopyDone or closed
  the connection (``peer_done`` / ``peer_closed`` say which);
- ``receive_nowait()`` -> a payload already buffered, else ``trio.WouldBlock`` (drain what
  has arrived without waiting: batching);
- ``await send(payload)``, ``await send_many(payloads)`` (all frames in one ``send_all``),
  ``await send_raw(frames)`` (pre-framed CopyData bytes, for pipelines that build their
  output incrementally with ``append_copy_data``), ``await send_done()``.

Always write through these methods rather than ``transport.send_all``: the server
connection tracks interrupted writes so it never appends an ErrorResponse to half a frame.

Concurrency rule: ONE receiving task and ONE sending task at a time (they may be different
tasks and run concurrently: a reader task and a writer task is the intended shape). Two
tasks sending at once raise ``trio.BusyResourceError`` from the transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from protocol.errors import LocalProtocolError
from protocol.pgwire.messages import CopyDone as CopyDoneMsg
from protocol.pgwire.messages import append_copy_data, encode, encode_copy_data

if TYPE_CHECKING:
    import trio

Payload = bytes | bytearray | memoryview


class CopyEndpoint(Protocol):
    """What a connection provides to its copy stream (server and client connections)."""

    @property
    def transport(self) -> trio.abc.Stream: ...

    async def copy_receive(self, stream: CopyBothStream) -> bytes | None: ...

    def copy_receive_nowait(self, stream: CopyBothStream) -> bytes | None: ...

    async def send_bytes(self, data: bytes | bytearray) -> None: ...


class CopyBothStream:
    """CopyData in both directions (CopyBoth) or one (CopyOut on the server / CopyIn)."""

    __slots__ = (
        "_endpoint",
        "can_receive",
        "can_send",
        "command_tag",
        "peer_closed",
        "peer_done",
        "sent_done",
    )

    def __init__(
        self,
        endpoint: CopyEndpoint,
        *,
        can_receive: bool = True,
        can_send: bool = True,
        command_tag: str = "COPY",
    ) -> None:
        self._endpoint = endpoint
        self.can_receive = can_receive
        self.can_send = can_send
        self.peer_done = False
        self.peer_closed = False
        self.sent_done = False
        # Server side: the CommandComplete tag sent when the handler returns.
        self.command_tag = command_tag

    @property
    def transport(self) -> trio.abc.Stream:
        """The raw byte stream (peer address, socket options). Write via ``send_raw``."""
        return self._endpoint.transport

    @property
    def finished_receiving(self) -> bool:
        return self.peer_done or self.peer_closed

    async def receive(self) -> bytes | None:
        """The next CopyData payload; ``None`` once the peer sent CopyDone or hung up."""
        if not self.can_receive:
            raise LocalProtocolError("this copy stream is send-only")
        if self.finished_receiving:
            return None
        return await self._endpoint.copy_receive(self)

    def receive_nowait(self) -> bytes | None:
        """Like ``receive`` but only from bytes already buffered; raises ``trio.WouldBlock``."""
        if not self.can_receive:
            raise LocalProtocolError("this copy stream is send-only")
        if self.finished_receiving:
            return None
        return self._endpoint.copy_receive_nowait(self)

    def _check_send(self) -> None:
        if not self.can_send:
            raise LocalProtocolError("this copy stream is receive-only")
        if self.sent_done:
            raise LocalProtocolError("send after CopyDone")

    async def send(self, payload: Payload) -> None:
        self._check_send()
        await self._endpoint.send_bytes(encode_copy_data(payload))

    async def send_many(self, payloads: Iterable[Payload]) -> None:
        """Frame every payload as CopyData and write them with one ``send_all``."""
        self._check_send()
        out = bytearray()
        for p in payloads:
            append_copy_data(out, p)
        if out:
            await self._endpoint.send_bytes(out)

    async def send_raw(self, frames: bytes | bytearray) -> None:
        """Write bytes that are already framed CopyData messages (built with
        ``protocol.pgwire.messages.append_copy_data``), e.g. a whole batch of responses."""
        self._check_send()
        if frames:
            await self._endpoint.send_bytes(frames)

    async def send_done(self) -> None:
        """Send CopyDone: no more CopyData from this side."""
        self._check_send()
        self.sent_done = True
        await self._endpoint.send_bytes(encode(CopyDoneMsg()))
