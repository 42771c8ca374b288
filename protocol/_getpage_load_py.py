"""The GetPage load generator of ``pagestore bench getpage`` (kernel 4), pure Python: the
reference twin of ``protocol/_getpage_load_c.pyx``.

Sans-IO: ``GetPageLoad`` writes framed pagestream v3 GetPage requests for uniformly random
blocks of one relation, or of several (every block of every relation equally likely, as Neon's
pagebench picks keys over a timeline's relation blocks), and reads the server's byte stream back, matching each response to the
oldest request in flight (a pagestream answers in order) and keeping one latency per answer
(microseconds from the send of its request to the receive of the bytes that completed it).
The bench's client loop is then only ``recv_into`` / ``feed`` / ``sendall``: with a Python
loop per request the load generator cost about as much CPU per page as the server it
measures (PostgreSQL's baseline is driven by pgbench, which is C).

The blocks come from splitmix64 (the same sequence in both twins for the same seed), taken
modulo ``pages`` (with several relations: modulo their total, then the relation whose range
holds it; one relation gives the same blocks either way). Every response is checked: CopyData framing (length 4..2 MiB), a GetPage
answer of exactly the v3 size echoing the request's reqid, LSNs, relation and block.
A pagestream Error response or a libpq ErrorResponse raises ``LoadServerError`` with the
server's message; anything else malformed raises ``LoadProtocolError``. After an error the
object must not be fed again (what was in flight is unknown).
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "MAX_RELS", "GetPageLoad", "LoadProtocolError", "LoadServerError"]

IMPL: Final = "python"

MAX_LSN: Final = 0xFFFF_FFFF_FFFF_FFFF
MAX_MESSAGE_LEN: Final = 2 * 1024 * 1024
BLCKSZ: Final = 8192
TAG_GET_PAGE_REQUEST: Final = 2
TAG_GET_PAGE: Final = 102
TAG_ERROR: Final = 103
# 'd', length, then the v3 GetPage request: tag, reqid, lsn, not_modified_since, rel, blkno
REQUEST: Final = struct.Struct(">cIBQQQIIIBI")
REQUEST_LEN: Final = REQUEST.size - 1
# the v3 GetPage response header (the page follows) and the v3 Error header (a C string follows)
RESPONSE_HEAD: Final = struct.Struct(">BQQQIIIBI")
GETPAGE_PAYLOAD: Final = RESPONSE_HEAD.size + BLCKSZ
ERROR_HEAD: Final = struct.Struct(">BQQQ")
_FRAME: Final = struct.Struct(">BI")
_MASK: Final = (1 << 64) - 1
_U32_MAX: Final = 0xFFFF_FFFF
# at most this many relations in one load (their ranges are searched per request)
MAX_RELS: Final = 1 << 20


class LoadProtocolError(ValueError):
    """The server's bytes are not the answers to the requests in flight."""


class LoadServerError(RuntimeError):
    """The server answered a request with an error (pagestream Error or libpq ErrorResponse)."""


def _check_u32(name: str, value: int) -> None:
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{name} {value} does not fit in 32 bits")


class GetPageLoad:
    """One pagestream v3 connection's load: see the module docstring."""

    __slots__ = (
        "_blk",
        "_buf",
        "_count",
        "_flight",
        "_lat",
        "_next_reqid",
        "_rels",
        "_starts",
        "_state",
        "pages",
    )

    def __init__(
        self,
        rel: tuple[int, int, int, int] | Sequence[tuple[int, int, int, int]],
        pages: int | Sequence[int],
        seed: int,
        first_reqid: int = 1,
    ) -> None:
        """``rel`` (spcnode, dbnode, relnode, forknum) with ``pages`` blocks, or a sequence of
        relations with a sequence of their block counts (each 1..2^32)."""
        if isinstance(pages, int):
            rels: Sequence[tuple[int, int, int, int]] = [rel]  # type: ignore[list-item]
            sizes: Sequence[int] = [pages]
        else:
            rels, sizes = rel, pages  # type: ignore[assignment]
            if len(rels) != len(sizes):
                raise ValueError(f"{len(rels)} relations but {len(sizes)} sizes")
            if not 1 <= len(rels) <= MAX_RELS:
                raise ValueError(f"{len(rels)} relations: want 1..{MAX_RELS}")
        self._rels: list[tuple[int, int, int, int]] = []
        self._starts: list[int] = []  # each relation's first flat block index
        total = 0
        for one, size in zip(rels, sizes, strict=True):
            spcnode, dbnode, relnode, forknum = one
            for name, v in (("spcnode", spcnode), ("dbnode", dbnode), ("relnode", relnode)):
                _check_u32(name, v)
            if not 0 <= forknum <= 255:
                raise ValueError(f"forknum {forknum} does not fit in 8 bits")
            if not 1 <= size <= _U32_MAX + 1:
                raise ValueError(f"pages {size} must be 1..2^32")
            self._rels.append((spcnode, dbnode, relnode, forknum))
            self._starts.append(total)
            total += size
        if not 0 <= first_reqid <= _MASK or not 0 <= seed <= _MASK:
            raise ValueError("seed and first_reqid must fit in 64 bits")
        self.pages = total
        self._state = seed
        self._next_reqid = first_reqid
        # (reqid, relation index, blkno, sent_ns) of the requests in flight, oldest first
        self._flight: deque[tuple[int, int, int, int]] = deque()
        self._buf = bytearray()  # received bytes not yet a whole message
        self._lat = array("I")
        self._count = 0
        self._blk = 0

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    @property
    def count(self) -> int:
        """Responses received and checked."""
        return self._count

    def latencies_us(self) -> array[int]:
        """One latency per response, in the order received (a copy)."""
        return array("I", self._lat)

    def _next_block(self) -> tuple[int, int]:
        """(relation index, block) of the next request."""
        s = self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        k = (z ^ (z >> 31)) % self.pages
        i = bisect_right(self._starts, k) - 1
        return i, k - self._starts[i]

    def requests(self, n: int, now_ns: int) -> bytes:
        """``n`` framed GetPage requests, sent (for the latencies) at ``now_ns``."""
        if n < 0:
            raise ValueError(f"cannot send {n} requests")
        out = bytearray()
        self._append(out, n, now_ns)
        return bytes(out)

    def _append(self, out: bytearray, n: int, now_ns: int) -> None:
        flight, rels = self._flight, self._rels
        for _ in range(n):
            reqid = self._next_reqid
            self._next_reqid = (reqid + 1) & _MASK
            i, blk = self._next_block()
            spc, db, relnode, fork = rels[i]
            out += REQUEST.pack(
                b"d", REQUEST_LEN, TAG_GET_PAGE_REQUEST, reqid, MAX_LSN, 0, spc, db, relnode,
                fork, blk,
            )
            flight.append((reqid, i, blk, now_ns))

    def feed(self, data: Buffer, now_ns: int, resend: bool) -> bytes:
        """Take received bytes; returns the requests to send now: one new one per response
        completed by ``data`` if ``resend`` (a closed loop), else none."""
        buf = self._buf
        buf += memoryview(data).cast("B")
        pos, end = 0, len(buf)
        answered = 0
        flight, lat, rels = self._flight, self._lat, self._rels
        while end - pos >= 5:
            tag, length = _FRAME.unpack_from(buf, pos)
            if length < 4 or length > MAX_MESSAGE_LEN:
                raise LoadProtocolError(f"bad message length {length}")
            if end - pos - 1 < length:
                break
            start, pos = pos + 5, pos + 1 + length
            size = length - 4
            if tag == 0x45:  # 'E': libpq ErrorResponse
                raise LoadServerError(_libpq_error_text(buf[start:pos]))
            if tag != 0x64:  # 'd'
                raise LoadProtocolError(f"unexpected message {tag:#04x} during the pagestream")
            if not flight:
                raise LoadProtocolError("a response with no request in flight")
            if size < 1:
                raise LoadProtocolError("empty pagestream response")
            reqid, i, blk, sent = flight.popleft()
            rtag = buf[start]
            if rtag == TAG_ERROR:
                if size < ERROR_HEAD.size + 1:
                    raise LoadProtocolError("truncated pagestream Error response")
                raw = bytes(buf[start + ERROR_HEAD.size : pos])
                raise LoadServerError(raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
            if rtag != TAG_GET_PAGE:
                raise LoadProtocolError(f"unexpected pagestream response tag {rtag}")
            if size != GETPAGE_PAYLOAD:
                raise LoadProtocolError(f"GetPage response of {size} bytes, not {GETPAGE_PAYLOAD}")
            v = RESPONSE_HEAD.unpack_from(buf, start)
            if v[1:] != (reqid, MAX_LSN, 0, *rels[i], blk):
                raise LoadProtocolError(
                    f"response for reqid {v[1]} block {v[8]} does not answer reqid {reqid} "
                    f"block {blk}"
                )
            us = (now_ns - sent) // 1000
            lat.append(1 if us < 1 else _U32_MAX if us > _U32_MAX else us)
            self._count += 1
            answered += 1
        del buf[:pos]
        if not resend or not answered:
            return b""
        out = bytearray()
        self._append(out, answered, now_ns)
        return bytes(out)


def _libpq_error_text(body: Buffer) -> str:
    """The M (message) field of a libpq ErrorResponse body, or the whole body."""
    raw = bytes(body)
    for field in raw.split(b"\0"):
        if field[:1] == b"M":
            return field[1:].decode("utf-8", "replace")
    return raw.decode("utf-8", "replace")
