"""A TLS stream over a trio socket that hands the reader everything already received.

``trio.SSLStream`` returns at most one TLS record per ``receive_some``: a client that sends
each pagestream request in its own ``send`` (a compute's smgr, the benchmarks) then reaches
the page service one request per receive, and the pipeline's batching (which folds whatever
arrived while the executor was busy) falls from ~24 requests per batch to ~3. This stream
decrypts every complete record that is buffered before returning, so a receive over TLS
yields what a receive over plaintext TCP would.

Built on ``ssl.SSLObject`` with memory BIOs (what ``trio.SSLStream`` uses too), server or
client side. Rules: one task receives and one task sends at a time (the libpq rule of
``common.pgserver``); TLS 1.3 post-handshake messages a read produces (key updates) are sent
under the same send lock. EOF without close_notify is reported as EOF (``b""``): the libpq and
pagestream framing above detects truncation itself.
"""

from __future__ import annotations

import ssl

import trio

RECEIVE_SIZE = 256 * 1024


class TlsStream(trio.abc.Stream):
    def __init__(
        self,
        transport: trio.SocketStream,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self.transport_stream = transport
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = context.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        self._send_lock = trio.Lock()
        self._eof = False

    async def _flush(self) -> None:
        if self._out.pending:
            async with self._send_lock:
                data = self._out.read()
                if data:
                    await self.transport_stream.send_all(data)

    async def _fill(self) -> None:
        data = await self.transport_stream.receive_some(RECEIVE_SIZE)
        if not data:
            self._eof = True
            self._in.write_eof()
        else:
            self._in.write(data)

    async def do_handshake(self) -> None:
        while True:
            try:
                self._obj.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
                if self._eof:
                    raise trio.BrokenResourceError("peer closed during the TLS handshake") from None
                continue
            except ssl.SSLError as exc:
                await self._flush_quietly()
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
            await self._flush()
            return

    async def _flush_quietly(self) -> None:
        try:
            await self._flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def getpeercert(self) -> dict[str, object] | None:
        cert = self._obj.getpeercert()
        return dict(cert) if cert else None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        limit = max_bytes or RECEIVE_SIZE
        chunks: list[bytes] = []
        have = 0
        while True:
            try:
                while have < limit:
                    piece = self._obj.read(limit - have)
                    if not piece:
                        break
                    chunks.append(piece)
                    have += len(piece)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                self._eof = True
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
            if self._out.pending:
                await self._flush()
            if chunks:
                await trio.lowlevel.checkpoint()
                return b"".join(chunks)
            if self._eof:
                await trio.lowlevel.checkpoint()
                return b""
            await self._fill()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._obj.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
        await self._flush()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """close_notify (best effort), then close the socket."""
        try:
            try:
                self._obj.unwrap()
            except ssl.SSLError:
                pass
            with trio.move_on_after(0.5):
                await self._flush_quietly()
        finally:
            await self.transport_stream.aclose()
