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
from typing import Final

from protocol.errors import PROTOCOL_VIOLATION, LocalProtocolError, RemoteProtocolError

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

    ``_data[_start:]`` is the live part. ``consume`` only moves ``_start``; the dead prefix is
    deleted when it is both large and at least half the array, so compaction is amortised
    O(1) per byte. No memoryview into ``_data`` is ever handed out (it would pin the array
    and make resizing raise), callers get ``bytes`` copies of what they take.
    """

    __slots__ = ("_data", "_start")

    _COMPACT_MIN: Final = 64 * 1024

    def __init__(self) -> None:
        self._data = bytearray()
        self._start = 0

    def __len__(self) -> int:
        return len(self._data) - self._start

    def __bool__(self) -> bool:
        return len(self._data) > self._start

    def append(self, data: Buffer) -> None:
        self._data += data

    def peek(self, n: int) -> bytes:
        """Up to ``n`` bytes from the front, not consumed."""
        return bytes(self._data[self._start : self._start + n])

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
        out = bytes(self._data[start : start + n])
        self.consume(n)
        return out

    def consume(self, n: int) -> None:
        self._start += n
        if self._start == len(self._data):
            self._data.clear()
            self._start = 0
        elif self._start >= self._COMPACT_MIN and self._start * 2 >= len(self._data):
            del self._data[: self._start]
            self._start = 0

    def find(self, sub: int | bytes, offset: int = 0) -> int:
        """Index of ``sub`` relative to the front, at or after ``offset``; -1 if absent."""
        idx = self._data.find(sub, self._start + offset)
        return idx - self._start if idx >= 0 else -1

    def clear(self) -> None:
        self._data.clear()
        self._start = 0


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
