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

Fast paths for a caller that manages its own schedule points (the page service's
``DirectStreamIO``, as it does on plaintext sockets): ``receive_nowait`` decrypts what is
buffered and reads the socket once without blocking; ``send_nowait`` encrypts and writes what
the socket takes now, and ``flush`` waits for the rest. Neither costs an event-loop iteration
when the socket is ready, which is what TLS cost per batch over plaintext beyond the cipher.
"""

from __future__ import annotations

import os
import ssl
from typing import cast

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
        # True while one task is sending the outgoing BIO. Not a trio.Lock: acquiring one is a
        # schedule point per send, and the only second sender (a read that produced a TLS
        # 1.3 post-handshake message) is rare.
        self._sending = False
        self._idle = trio.Event()
        self._eof = False
        # Decrypted bytes land here: SSLObject.read(n) without a buffer allocates n bytes per
        # call (a 256 KiB allocation per TLS record, and per call that finds none).
        self._buf = bytearray(RECEIVE_SIZE)
        self._view = memoryview(self._buf)
        self._raw = bytearray(RECEIVE_SIZE)
        self._raw_view = memoryview(self._raw)
        self._fd = transport.socket.fileno()
        # encrypted bytes taken from the outgoing BIO and not yet written (send_nowait)
        self._unsent = memoryview(b"")
        # Set by receive_nowait: its socket read found the kernel drained (a caller that
        # knows no request can be on its way, as at queue depth 1, waits before reading).
        self.drained = False

    async def _flush(self) -> None:
        while self._sending:
            await self._idle.wait()  # the other task's loop sends what is pending now
        if not self._out.pending and not self._unsent:
            return
        self._sending = True
        try:
            while self._unsent or self._out.pending:
                chunk = self._unsent if self._unsent else memoryview(self._out.read())
                self._unsent = memoryview(b"")
                await self.transport_stream.send_all(chunk)
        finally:
            self._sending = False
            self._idle.set()
            self._idle = trio.Event()

    async def _fill(self) -> None:
        # recv_into one buffer: SocketStream.receive_some(n) allocates n bytes per call.
        try:
            n = await self.transport_stream.socket.recv_into(self._raw_view)
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        if not n:
            self._eof = True
            self._in.write_eof()
        else:
            self._in.write(self._raw_view[:n])

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
        limit = min(max_bytes or RECEIVE_SIZE, RECEIVE_SIZE)
        waited = False  # a receive that awaited the socket has had its schedule point
        while True:
            have = self._read_plain(limit)
            if self._out.pending:
                await self._flush()
            if have or self._eof:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return bytes(self._view[:have])
            await self._fill()
            waited = True

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._obj.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
        await self._flush()

    # -- fast paths (no schedule point; see the module docstring) ---------------------------

    def _write_nowait(self) -> bool:
        """Write pending encrypted bytes as far as the socket takes them; True when none is
        left. Only when no task is in ``_flush`` (it owns the order of the bytes then)."""
        if self._sending:
            return not self._unsent and not self._out.pending
        while True:
            if not self._unsent:
                if not self._out.pending:
                    return True
                self._unsent = memoryview(self._out.read())
            try:
                n = os.write(self._fd, self._unsent)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            self._unsent = self._unsent[n:]

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        """Encrypt ``data`` and write what the socket takes now; True when all of it went,
        else ``flush()`` sends the rest (in order, before anything sent later)."""
        try:
            self._obj.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
        return self._write_nowait()

    async def flush(self) -> None:
        """Send every encrypted byte still pending (waits for the socket)."""
        await self._flush()

    def _read_plain(self, limit: int) -> int:
        view, obj, incoming = self._view, self._obj, self._in
        have = 0
        try:
            # Only when a read can give something: bytes in the incoming BIO, decrypted bytes
            # in the SSL object, or the socket's EOF (read() reports it). A read that cannot
            # raises SSLWantReadError, and building that exception costs more than the read
            # of a small request: without the check every receive ended in one.
            while have < limit and (incoming.pending or obj.pending() or incoming.eof):
                # With a buffer, read() returns the count (typeshed says bytes).
                n = cast(int, obj.read(limit - have, view[have:limit]))
                if not n:
                    break
                have += n
        except ssl.SSLWantReadError:
            pass  # a partial record: the rest is still on its way
        except ssl.SSLZeroReturnError:
            self._eof = True
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
        return have

    def receive_nowait(self, max_bytes: int) -> bytes | None:
        """``receive_some`` without waiting: the decrypted bytes of every complete record
        already received (the socket read once, without blocking), ``b""`` at EOF, or None
        when nothing is there now (``wait_readable``, then again)."""
        limit = min(max_bytes, RECEIVE_SIZE)
        have = self._read_plain(limit)
        self.drained = False
        if not have and not self._eof:
            try:
                n = os.readv(self._fd, [self._raw_view])
            except BlockingIOError:
                n = -1
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            if n == 0:
                self._eof = True
                self._in.write_eof()
            elif n > 0:
                self._in.write(self._raw_view[:n])
            have = self._read_plain(limit)
            # Bytes returned, the kernel gave less than asked and every complete record is
            # decrypted: the next receive_nowait would only find EAGAIN.
            self.drained = (
                0 < n < RECEIVE_SIZE and have > 0 and not self._in.pending and not self._obj.pending()
            )
        if self._out.pending:
            self._write_nowait()  # a post-handshake message the read produced; rest: flush()
        if have or self._eof:
            return bytes(self._view[:have])
        return None

    @property
    def unsent(self) -> bool:
        """Encrypted bytes wait for ``flush()``."""
        return bool(self._unsent) or self._out.pending > 0

    async def wait_readable(self) -> None:
        await trio.lowlevel.wait_readable(self.transport_stream.socket)

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
