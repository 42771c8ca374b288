"""A blocking TLS socket over memory BIOs whose receive hands back every record already received.

``ssl.SSLSocket`` reads through OpenSSL's socket BIO without read-ahead: two ``read`` system
calls per TLS record (its 5-byte header, then its body) and at most one record per
``recv_into``. A load driver in a closed loop (``bench getpage``'s client processes, through
``compute.page_client.BlockingPageClient``) then wakes once per 16 KiB record, two pages,
and answers each wake with a small send: the server sees four times the requests' sends and
the driver pays a system call and a Python round per record, on the cores the server needs.

This socket reads the kernel's whole buffer with one ``recv_into`` into the incoming BIO and
decrypts every complete record in it before returning, so a receive over TLS yields what a
receive over plaintext TCP would; a send encrypts into the outgoing BIO and writes it with one
``sendall``. The TLS itself is the context's: ``common.tls.client_context`` verifies the chain
and the host name during the handshake exactly as ``SSLContext.wrap_socket`` does (both are
``SSL_do_handshake`` on the same ``SSL_CTX``).

Rules: one thread uses it at a time. EOF without close_notify (the peer's socket closed) is
reported as EOF (``0`` / ``b""``), as ``wrap_socket``'s default ``suppress_ragged_eofs`` does:
the framing above detects a truncated stream itself. TLS 1.3 post-handshake messages a read
produces (key updates) are sent before the read returns.
"""

from __future__ import annotations

import socket
import ssl
from typing import cast

from protocol.pgwire.errors import PgError

RECEIVE_SIZE = 1 << 20


class BlockingTlsSocket:
    """The ``sendall`` / ``recv`` / ``recv_into`` / ``settimeout`` / ``close`` of a socket."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str) -> None:
        self.sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_hostname=server_hostname)
        self._raw = bytearray(RECEIVE_SIZE)
        self._raw_view = memoryview(self._raw)
        self._eof = False

    def do_handshake(self) -> None:
        """Raises ``ssl.SSLError`` (``SSLCertVerificationError`` for an untrusted certificate
        or a wrong host name) as ``wrap_socket`` would; the alert goes to the server first."""
        while True:
            try:
                self._obj.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ssl.SSLEOFError("the server closed the connection during the TLS handshake") from None
                continue
            except ssl.SSLError:
                self._flush_quietly()
                raise
            self._flush()
            return

    def _flush(self) -> None:
        if self._out.pending:
            self.sock.sendall(self._out.read())

    def _flush_quietly(self) -> None:
        try:
            self._flush()
        except OSError:
            pass

    def _fill(self) -> bool:
        """One blocking read of whatever the kernel has into the incoming BIO; False at EOF."""
        n = self.sock.recv_into(self._raw_view)
        if not n:
            self._eof = True
            self._in.write_eof()
            return False
        self._in.write(self._raw_view[:n])
        return True

    def getpeercert(self) -> dict[str, object] | None:
        cert = self._obj.getpeercert()
        return dict(cert) if cert else None

    def version(self) -> str | None:
        return self._obj.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self._obj.cipher()

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        self._obj.write(data)
        self.sock.sendall(self._out.read())

    def recv_into(self, buffer: bytearray | memoryview, nbytes: int = 0) -> int:
        """Blocks until at least one byte is decrypted, then returns every decrypted byte
        already there (up to ``nbytes`` or the buffer's size); 0 at EOF."""
        view = memoryview(buffer).cast("B")
        limit = min(nbytes or len(view), len(view))
        if not limit:
            return 0
        obj, incoming = self._obj, self._in
        have = 0
        while True:
            try:
                # Only when a read can give something (a read that cannot raises
                # SSLWantReadError, which costs more than a small read).
                while have < limit and (incoming.pending or obj.pending() or incoming.eof):
                    n = cast(int, obj.read(limit - have, view[have:limit]))
                    if not n:
                        break
                    have += n
            except ssl.SSLWantReadError:
                pass  # a partial record: the rest is still on its way
            except ssl.SSLZeroReturnError:
                self._eof = True  # close_notify
            except ssl.SSLEOFError:
                self._eof = True  # the socket's EOF without close_notify: EOF (see above)
            if self._out.pending:
                self._flush()  # a post-handshake message the read produced
            if have or self._eof:
                return have
            self._fill()

    def recv(self, bufsize: int) -> bytes:
        buf = bytearray(min(bufsize, RECEIVE_SIZE))
        n = self.recv_into(buf)
        return bytes(buf[:n])

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        """close_notify (best effort: only if the socket takes it now, and without waiting
        for the server's), then close."""
        try:
            self.sock.setblocking(False)
            try:
                self._obj.unwrap()
            except ssl.SSLError:
                pass
            self._flush_quietly()
        except OSError:
            pass
        finally:
            self.sock.close()


def start_tls(sock: socket.socket, context: ssl.SSLContext, host: str) -> BlockingTlsSocket:
    """PostgreSQL's SSLRequest on a connected blocking socket, then the handshake (the server's
    certificate verified by ``context``); ``PgError`` 08006 if the server does not do TLS."""
    from protocol.pgwire import messages as m

    sock.sendall(m.encode(m.SSLRequest()))
    answer = sock.recv(1)
    if answer != b"S":
        raise PgError("server does not support SSL, but SSL was required", "08006", severity="FATAL")
    tls = BlockingTlsSocket(sock, context, host)
    tls.do_handshake()
    return tls
