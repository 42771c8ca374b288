"""Byte buffers every codec shares: a receive buffer, a read cursor, and a write buffer.

- ``ReceiveBuffer`` accumulates bytes from the network. Consumed bytes are dropped lazily
  (a read offset moves; the bytearray is compacted only when the dead prefix is large), so
  taking N messages out of a buffer costs O(total bytes), never O(N * buffer) re-slicing.
- ``Reader`` is a cursor over one message body (a ``memoryview``). Every read checks the
  remaining length first; running out raises ``RemoteProtocolError`` (08P01) "truncated ...",
  because a short message is always the peer's fault. Integers are big-endian (network order)
  and decoded with precompiled ``struct.Struct`` objects.
- ``WriteBuffer`` builds outgoing bytes: ``new_message(tag)`` reserves the length word and
  ``end_message()`` back-patches it (PostgreSQL's length counts itself, not the tag).

API stability: other rooms decode pagestream, safekeeper and replication payloads with
``Reader``; keep these names and semantics stable.
"""

from __future__ import annotations

import builtins
import struct
import sys
from collections.abc import Callable
from typing import Final

from protocol import _native
from protocol.errors import PROTOCOL_VIOLATION, LocalProtocolError, RemoteProtocolError

_native.require("protocol._pq_c")
if _native.IMPL == "python":
    from protocol._pq_py import take_frames as _take_frames
else:
    from protocol._pq_c import take_frames as _take_frames

# Big-endian (network order) integer codecs, shared by all codecs in protocol/.
U8: Final = struct.Struct("!B")
U16: Final = struct.Struct("!H")
U32: Final = struct.Struct("!I")
U64: Final = struct.Struct("!Q")
I16: Final = struct.Struct("!h")
I32: Final = struct.Struct("!i")
I64: Final = struct.Struct("!q")
# PostgreSQL message header: tag byte + length (the length counts itself, not the tag).
TAG_LEN: Final = struct.Struct("!cI")

CHARACTER_NOT_IN_REPERTOIRE: Final = "22021"

Buffer = bytes | bytearray | memoryview


class Reader:
    """A bounds-checked cursor over a message body.

    ``what`` names the message in error texts ("truncated CopyData: need 8 bytes, have 3").
    The reader never copies except where it returns ``bytes``.
    """

    __slots__ = ("_pos", "_raw", "_view", "what")

    def __init__(self, data: Buffer, what: str = "message") -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self._view = view
        self._pos = 0
        self.what = what
        # Something with a C-level find() for NUL scanning; built lazily from a memoryview.
        self._raw: builtins.bytes | bytearray | None = (
            data if isinstance(data, builtins.bytes | bytearray) else None
        )

    # -- position -------------------------------------------------------------------------

    @property
    def pos(self) -> int:
        return self._pos

    @property
    def remaining(self) -> int:
        return len(self._view) - self._pos

    def at_end(self) -> bool:
        return self._pos >= len(self._view)

    def expect_end(self) -> None:
        """Raise if bytes are left over: a message longer than its fields is malformed."""
        if self._pos != len(self._view):
            raise RemoteProtocolError(
                f"malformed {self.what}: {len(self._view) - self._pos} trailing bytes",
                sqlstate=PROTOCOL_VIOLATION,
            )

    def _need(self, n: int) -> int:
        pos = self._pos
        if n < 0 or pos + n > len(self._view):
            raise RemoteProtocolError(
                f"truncated {self.what}: need {n} bytes at offset {pos}, have {len(self._view) - pos}",
                sqlstate=PROTOCOL_VIOLATION,
            )
        self._pos = pos + n
        return pos

    # -- integers (big-endian) ------------------------------------------------------------

    def u8(self) -> int:
        return int(U8.unpack_from(self._view, self._need(1))[0])

    def u16(self) -> int:
        return int(U16.unpack_from(self._view, self._need(2))[0])

    def u32(self) -> int:
        return int(U32.unpack_from(self._view, self._need(4))[0])

    def u64(self) -> int:
        return int(U64.unpack_from(self._view, self._need(8))[0])

    def i16(self) -> int:
        return int(I16.unpack_from(self._view, self._need(2))[0])

    def i32(self) -> int:
        return int(I32.unpack_from(self._view, self._need(4))[0])

    def i64(self) -> int:
        return int(I64.unpack_from(self._view, self._need(8))[0])

    def unpack(self, codec: struct.Struct) -> tuple[object, ...]:
        """Read a whole precompiled struct at once (the fast path for fixed headers)."""
        return codec.unpack_from(self._view, self._need(codec.size))

    # -- byte strings ---------------------------------------------------------------------

    def bytes(self, n: int) -> builtins.bytes:
        start = self._need(n)
        return self._view[start : start + n].tobytes()

    def view(self, n: int) -> memoryview:
        """The next ``n`` bytes without copying (valid as long as the underlying buffer)."""
        start = self._need(n)
        return self._view[start : start + n]

    def rest(self) -> builtins.bytes:
        start = self._pos
        self._pos = len(self._view)
        return self._view[start:].tobytes()

    def rest_view(self) -> memoryview:
        start = self._pos
        self._pos = len(self._view)
        return self._view[start:]

    def skip(self, n: int) -> None:
        self._need(n)

    def cstring(self) -> builtins.bytes:
        """A NUL-terminated byte string (the NUL is consumed, not returned)."""
        view = self._view
        pos = self._pos
        raw = self._raw
        if raw is None:
            # memoryview has no find(): copy once, then every later cstring scans in C.
            raw = self._raw = view.tobytes()
        end = raw.find(0, pos)
        if end < 0:
            raise RemoteProtocolError(
                f"truncated {self.what}: string at offset {pos} has no NUL terminator",
                sqlstate=PROTOCOL_VIOLATION,
            )
        self._pos = end + 1
        return view[pos:end].tobytes()

    def cstr(self) -> str:
        """A NUL-terminated UTF-8 string."""
        raw: builtins.bytes = self.cstring()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(
                f"invalid UTF-8 in {self.what}", sqlstate=CHARACTER_NOT_IN_REPERTOIRE
            ) from None

    def text(self, n: int) -> str:
        """``n`` bytes of UTF-8 text (no terminator)."""
        raw: builtins.bytes = self.bytes(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(
                f"invalid UTF-8 in {self.what}", sqlstate=CHARACTER_NOT_IN_REPERTOIRE
            ) from None


class ReceiveBuffer:
    """Bytes received but not yet consumed.

    ``_data[_start:_end]`` is the live part; ``_data[_end:]`` is free room that ``writable``
    lends to ``recv_into``. ``consume`` only moves ``_start``; the dead prefix is deleted
    when it is both large and at least half the array, so compaction is amortised O(1) per
    byte.

    Two ways out: ``take`` returns a ``bytes`` copy (the array stays private and may be
    resized), ``take_view`` a zero-copy ``memoryview`` (the receive fast path). Once a view
    was handed out the array is *lent*: it is never resized, compacted or written below
    ``_end`` again, so no view ever sees its bytes change. When a lent array runs out of room
    the live tail moves to another array and the lent one is retired; a retired array is
    reused only when no view of it is left (every buffer export holds a reference to the
    bytearray, so its reference count says so exactly).
    """

    __slots__ = (
        "_arena_size",
        "_data",
        "_end",
        "_lent",
        "_retired",
        "_start",
        "_window",
        "_zero_copy",
    )

    _COMPACT_MIN: Final = 64 * 1024
    # Capacity of the arrays the zero-copy path receives into. Large, so that the partial
    # message carried over to the next array at a switch is a small share of the traffic.
    ARENA_SIZE: Final = 2 * 1024 * 1024
    # Retired arrays kept for reuse; views outliving more than this many are left to the GC.
    _MAX_RETIRED: Final = 8
    # An array that only ``take`` used is not kept beyond this size once drained.
    _KEEP_MAX: Final = 4 * 1024 * 1024

    def __init__(self, arena_size: int = ARENA_SIZE) -> None:
        self._arena_size = arena_size
        self._data = bytearray()
        self._start = 0
        self._end = 0
        self._lent = False
        # Set by the first view handed out: from then on arrays are ARENA_SIZE and recycled.
        self._zero_copy = False
        self._retired: list[bytearray] = []
        self._window: memoryview | None = None

    def __len__(self) -> int:
        return self._end - self._start

    def __bool__(self) -> bool:
        return self._end > self._start

    def append(self, data: Buffer) -> None:
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        end = self._end
        if end + n <= len(self._data):
            self._data[end : end + n] = data
            self._end = end + n
        elif not self._lent:
            # Private array: grow it (bytearray over-allocates, amortised O(1) per byte).
            del self._data[end:]
            self._data += data
            self._end = len(self._data)
        else:
            self._move_to_fresh(n)
            end = self._end
            self._data[end : end + n] = data
            self._end = end + n

    def writable(self, min_size: int) -> memoryview:
        """Free room of at least ``min_size`` bytes after the live part, to receive into;
        ``commit(n)`` then adds its first ``n`` bytes. Nothing else may touch the buffer in
        between; ``commit`` releases the view."""
        if self._window is not None:
            raise LocalProtocolError("writable() twice without commit()")
        if len(self._data) - self._end < min_size:
            self._move_to_fresh(min_size)
        window = self._window = memoryview(self._data)[self._end :]
        return window

    def commit(self, n: int) -> None:
        """Add the first ``n`` bytes of the last ``writable`` view to the live part."""
        window = self._window
        if window is None:
            raise LocalProtocolError("commit() without writable()")
        if not 0 <= n <= len(window):
            raise LocalProtocolError(f"commit({n}) with a {len(window)}-byte window")
        window.release()
        self._window = None
        self._end += n

    def _move_to_fresh(self, need: int) -> None:
        """Make room for ``need`` more bytes: compact a private array in place if it is big
        enough, else move the live tail to an array that nobody else can see (a retired one
        without views left, or a new one)."""
        live = self._end - self._start
        old = self._data
        if not self._lent and live + need <= len(old):
            if live:
                with memoryview(old) as mv:
                    mv[:live] = mv[self._start : self._end]
            self._start = 0
            self._end = live
            return
        # Geometric growth for a message larger than an array: O(1) copies per byte. Only a
        # buffer that hands out views gets the large arrays (the others: what is needed).
        size = max(self._arena_size if self._zero_copy else 0, 2 * live + need)
        fresh = self._unused_retired(size)
        if fresh is None:
            fresh = bytearray(size)
        if live:
            fresh[:live] = memoryview(old)[self._start : self._end]
        if self._zero_copy and len(old) >= self._arena_size:
            self._retired.append(old)
            if len(self._retired) > self._MAX_RETIRED:
                del self._retired[0]
        self._data = fresh
        self._start = 0
        self._end = live
        self._lent = False

    def _unused_retired(self, size: int) -> bytearray | None:
        retired = self._retired
        for k in range(len(retired)):
            # References: the list's and getrefcount's argument; a live view adds one.
            if sys.getrefcount(retired[k]) == 2 and len(retired[k]) >= size:
                return retired.pop(k)
        return None

    def peek(self, n: int) -> bytes:
        """Up to ``n`` bytes from the front, not consumed."""
        start = self._start
        return bytes(memoryview(self._data)[start : min(start + n, self._end)])

    def byte_at(self, i: int) -> int:
        """The byte ``i`` positions from the front (caller checks ``len``)."""
        return self._data[self._start + i]

    def unpack_from(self, codec: struct.Struct, offset: int = 0) -> tuple[object, ...]:
        """Decode a fixed header at ``offset`` from the front without consuming or copying."""
        if len(self) < offset + codec.size:
            raise LocalProtocolError("unpack_from past the end of the receive buffer")
        return codec.unpack_from(self._data, self._start + offset)

    def take(self, n: int) -> bytes:
        """Remove and return the first ``n`` bytes (caller checks ``len``)."""
        if n > len(self):
            raise LocalProtocolError(f"take({n}) with only {len(self)} bytes buffered")
        start = self._start
        out = bytes(memoryview(self._data)[start : start + n])
        self.consume(n)
        return out

    def take_view(self, n: int) -> memoryview:
        """Remove the first ``n`` bytes and return them without copying. The view stays
        valid and unchanged for as long as the caller holds it (see the class docstring)."""
        if n > len(self):
            raise LocalProtocolError(f"take_view({n}) with only {len(self)} bytes buffered")
        start = self._start
        # A fresh export per view: each one holds its own reference to the array.
        out = memoryview(self._data)[start : start + n]
        self._lent = self._zero_copy = True
        self.consume(n)
        return out

    def take_frames(self, tag: int, max_length: int, limit: int) -> list[memoryview]:
        """Zero-copy framing of consecutive complete messages with ``tag`` at the front
        (PostgreSQL framing: tag byte, then a length word that counts itself): their bodies
        as views, at most ``limit`` of them. Stops before the first message with another
        tag, a length outside ``4..max_length`` or one not fully buffered, and leaves it
        for the general decoder (which reports bad lengths)."""
        # The loop is a kernel (protocol/_pq_c.pyx, twin protocol/_pq_py.py): one export of
        # the array for the batch, its slices share it, so the array's reference count stays
        # raised while any of them lives.
        first = self._start
        out, start = _take_frames(self._data, first, self._end, tag, max_length, limit)
        if out:
            self._lent = self._zero_copy = True
            self.consume(start - first)
        return out

    def scan(self, fn: Callable[[bytearray, int, int, int], int], max_length: int) -> int:
        """Let ``fn`` consume complete messages at the front straight from the array:
        ``fn(array, start, end, max_length)`` returns the index where it stopped, and the
        bytes before it are consumed. ``fn`` must copy what it keeps (the array is reused
        once consumed). Returns the number of bytes consumed. A buffer that is scanned
        streams: it receives into ``ARENA_SIZE`` arrays, compacted in place."""
        if self._window is not None:
            raise LocalProtocolError("scan() while a writable() window is out")
        first = self._start
        stop = fn(self._data, first, self._end, max_length)
        if not first <= stop <= self._end:
            raise LocalProtocolError(f"scan stopped at {stop}, outside [{first}, {self._end}]")
        if stop > first:
            self._zero_copy = True
            self.consume(stop - first)
        return stop - first

    def consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            if self._lent:
                if sys.getrefcount(self._data) == 2:  # the attribute's and the argument's
                    self._lent = False  # no view is left: the array is private again
                else:
                    return
            self._start = self._end = 0
            if len(self._data) > self._KEEP_MAX:
                self._data = bytearray()
        elif (
            not self._lent
            # A streaming buffer keeps its array's size: _move_to_fresh compacts it in place
            # when room runs out (deleting the prefix would shrink it and force a new array).
            and not self._zero_copy
            and self._start >= self._COMPACT_MIN
            and self._start * 2 >= self._end
        ):
            del self._data[: self._start]
            self._end -= self._start
            self._start = 0

    def find(self, sub: int | bytes, offset: int = 0) -> int:
        """Index of ``sub`` relative to the front, at or after ``offset``; -1 if absent."""
        idx = self._data.find(sub, self._start + offset, self._end)
        return idx - self._start if idx >= 0 else -1

    def clear(self) -> None:
        self._start = self._end = 0
        if self._lent:
            self._data = bytearray()
            self._lent = False

    @property
    def capacity(self) -> int:
        """Bytes of receive memory this buffer holds (current and retired arrays)."""
        return len(self._data) + sum(len(a) for a in self._retired)

    def release_memory(self) -> bool:
        """Drop every array when nothing is buffered and no ``writable`` window is out, so
        that an idle connection holds no receive memory (the next ``writable`` or ``append``
        allocates again). Views handed out keep their own array alive and unchanged: it is
        only forgotten here, never reused. False (nothing done) if bytes are buffered."""
        if self._end != self._start or self._window is not None:
            return False
        self._data = bytearray()
        self._start = self._end = 0
        self._lent = False
        self._retired.clear()
        return True


class WriteBuffer:
    """An append-only builder for outgoing bytes.

    ``new_message(tag)`` writes the tag (if any) and reserves 4 bytes for the length;
    ``end_message()`` back-patches it with the number of bytes since the length word,
    itself included. Messages do not nest.
    """

    __slots__ = ("_data", "_msg_start")

    def __init__(self) -> None:
        self._data = bytearray()
        self._msg_start = -1

    def __len__(self) -> int:
        return len(self._data)

    def new_message(self, tag: bytes | None) -> None:
        if self._msg_start >= 0:
            raise LocalProtocolError("new_message() while another message is open")
        if tag is not None:
            if len(tag) != 1:
                raise LocalProtocolError(f"message tag must be one byte, got {tag!r}")
            self._data += tag
        self._msg_start = len(self._data)
        self._data += b"\0\0\0\0"

    def end_message(self) -> None:
        start = self._msg_start
        if start < 0:
            raise LocalProtocolError("end_message() without new_message()")
        length = len(self._data) - start
        if length > 0xFFFF_FFFF:
            raise LocalProtocolError(f"message too long: {length} bytes")
        U32.pack_into(self._data, start, length)
        self._msg_start = -1

    def write(self, data: Buffer) -> None:
        self._data += data

    def write_u8(self, v: int) -> None:
        self._data += U8.pack(v)

    def write_u16(self, v: int) -> None:
        self._data += U16.pack(v)

    def write_u32(self, v: int) -> None:
        self._data += U32.pack(v)

    def write_u64(self, v: int) -> None:
        self._data += U64.pack(v)

    def write_i16(self, v: int) -> None:
        self._data += I16.pack(v)

    def write_i32(self, v: int) -> None:
        self._data += I32.pack(v)

    def write_i64(self, v: int) -> None:
        self._data += I64.pack(v)

    def write_struct(self, codec: struct.Struct, *values: object) -> None:
        self._data += codec.pack(*values)

    def write_cstring(self, v: bytes) -> None:
        if 0 in v:
            raise LocalProtocolError("a C string cannot contain NUL")
        self._data += v
        self._data += b"\0"

    def write_cstr(self, v: str) -> None:
        self.write_cstring(v.encode("utf-8"))

    def getvalue(self) -> bytes:
        if self._msg_start >= 0:
            raise LocalProtocolError("getvalue() with an unfinished message")
        return bytes(self._data)

    def take(self) -> bytes:
        """Return everything written so far and start empty again."""
        out = self.getvalue()
        self._data.clear()
        return out
