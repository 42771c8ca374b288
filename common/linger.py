"""Lingering close: ending a TCP connection so that the last answer reaches the peer.

Closing a socket whose receive queue still holds unread bytes makes the kernel send a reset
instead of a FIN, and a reset can destroy what the peer has not read yet: a client still
pushing data (a proposer streaming WAL, a bulk COPY) would see "connection reset" in place of
the FATAL ErrorResponse that says why the server gave up. So a server that ends a connection
with an error first shuts its sending side (the peer reads everything sent, then EOF) and
then reads and discards what the peer still sends, until the peer closes or a time or byte
bound is reached; only then is the socket closed.
"""

from __future__ import annotations

import socket

import trio

__all__ = ["LINGER_BYTES", "LINGER_S", "linger"]

# How long, and how much, a closing connection keeps reading after its last answer: long
# enough for a client to read an error and close, short enough that a peer that never stops
# sending cannot hold the connection.
LINGER_S = 2.0
LINGER_BYTES = 64 << 20


async def linger(stream: trio.SocketStream, seconds: float = LINGER_S, max_bytes: int = LINGER_BYTES) -> None:
    """Shut the sending side of ``stream``'s socket, then discard what the peer sends until it
    closes, ``seconds`` pass or ``max_bytes`` were read. Never raises for socket errors (the
    peer may already be gone); the caller closes the stream afterwards."""
    sock = stream.socket
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return
    buf = bytearray(1 << 16)
    left = max_bytes
    with trio.move_on_after(seconds):
        while left > 0:
            try:
                n = await sock.recv_into(buf)
            except OSError:
                return
            if n == 0:
                return
            left -= n
