"""Values stored at (key, lsn): a page image or a WAL record, and their compact encoding.

Encoding (pagestore's own, not Neon's bincode): one tag byte, then the variant's fields with
fixed-width big-endian integers. Images and raw PostgreSQL records keep their payload as the
tail of the blob, so no length field is needed: the blob length (from the layer index or the
in-memory index) delimits it.

``will_init`` is true for images, for raw PostgreSQL records that initialize the page, and for
Test records built with ``will_init``. Native records always need a base page. Decoding hostile
bytes raises ``RemoteProtocolError`` with SQLSTATE XX001 (data corrupted), nothing else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

import attrs

from protocol.errors import RemoteProtocolError
from protocol.pgwire.sqlstate import DATA_CORRUPTED

TAG_IMAGE: Final = 0
TAG_POSTGRES: Final = 1
TAG_CLEAR_VM_FLAGS: Final = 2
TAG_CLOG_COMMITTED: Final = 3
TAG_CLOG_ABORTED: Final = 4
TAG_MULTIXACT_OFFSET: Final = 5
TAG_MULTIXACT_MEMBERS: Final = 6
TAG_TRUNCATE_VM: Final = 7
TAG_TEST: Final = 8

_NO_BLKNO = 0xFFFF_FFFF
_U32 = struct.Struct(">I")
_CLEAR_VM = struct.Struct(">IIB")
_CLOG_TS = struct.Struct(">q")
_MX_OFFSET = struct.Struct(">II")
_TRUNC_VM = struct.Struct(">IB")
_TEST_HDR = struct.Struct(">BII")  # flags, len(append), len(only_if)


@attrs.frozen
class Image:
    """A full page (or any full value: rel size, directory, control file)."""

    data: bytes
    will_init: bool = attrs.field(default=True, init=False)


@attrs.frozen
class PostgresRecord:
    """A raw PostgreSQL WAL record, replayed by the redo manager (``pageserver.walredo``)."""

    will_init: bool
    rec: bytes


@attrs.frozen
class ClearVisibilityMapFlags:
    new_heap_blkno: int | None
    old_heap_blkno: int | None
    flags: int
    will_init: bool = attrs.field(default=False, init=False)


@attrs.frozen
class ClogSetCommitted:
    xids: tuple[int, ...]
    timestamp: int
    will_init: bool = attrs.field(default=False, init=False)


@attrs.frozen
class ClogSetAborted:
    xids: tuple[int, ...]
    will_init: bool = attrs.field(default=False, init=False)


@attrs.frozen
class MultixactOffsetCreate:
    mid: int
    moff: int
    will_init: bool = attrs.field(default=False, init=False)


@attrs.frozen
class MultixactMembersCreate:
    moff: int
    members: tuple[tuple[int, int], ...]  # (xid, status)
    will_init: bool = attrs.field(default=False, init=False)


@attrs.frozen
class TruncateVisibilityMap:
    trunc_byte: int
    trunc_offs: int
    will_init: bool = attrs.field(default=False, init=False)


@attrs.frozen
class TestRecord:
    """Neon's ``Test`` record: makes the engine testable without PostgreSQL redo."""

    __test__ = False  # not a pytest test class

    append: str
    clear: bool = False
    will_init: bool = False
    only_if: str | None = None

    @classmethod
    def wal_append(cls, s: str) -> TestRecord:
        return cls(s)

    @classmethod
    def wal_append_conditional(cls, s: str, only_if: str) -> TestRecord:
        return cls(s, only_if=only_if)

    @classmethod
    def wal_clear(cls, s: str) -> TestRecord:
        return cls(s, clear=True)

    @classmethod
    def wal_init(cls, s: str) -> TestRecord:
        return cls(s, clear=True, will_init=True)


WalRecordValue = (
    PostgresRecord
    | ClearVisibilityMapFlags
    | ClogSetCommitted
    | ClogSetAborted
    | MultixactOffsetCreate
    | MultixactMembersCreate
    | TruncateVisibilityMap
    | TestRecord
)
Value = Image | WalRecordValue


def _opt_blk(v: int | None) -> int:
    return _NO_BLKNO if v is None else v


_POSTGRES_HEADS = (bytes((TAG_POSTGRES, 0)), bytes((TAG_POSTGRES, 1)))


def encode_postgres_record(will_init: bool, rec: bytes) -> bytes:
    """``encode_value(PostgresRecord(will_init, rec))`` without building the value (ingest)."""
    return _POSTGRES_HEADS[will_init] + rec


def encode_value(value: Value) -> bytes:
    """Serialize a value; the inverse of ``decode_value``."""
    if isinstance(value, Image):
        return b"\x00" + value.data
    if isinstance(value, PostgresRecord):
        return bytes((TAG_POSTGRES, 1 if value.will_init else 0)) + value.rec
    if isinstance(value, ClearVisibilityMapFlags):
        return bytes((TAG_CLEAR_VM_FLAGS,)) + _CLEAR_VM.pack(
            _opt_blk(value.new_heap_blkno), _opt_blk(value.old_heap_blkno), value.flags
        )
    if isinstance(value, ClogSetCommitted):
        xids = value.xids
        return (
            bytes((TAG_CLOG_COMMITTED,))
            + _CLOG_TS.pack(value.timestamp)
            + _U32.pack(len(xids))
            + struct.pack(f">{len(xids)}I", *xids)
        )
    if isinstance(value, ClogSetAborted):
        xids = value.xids
        return bytes((TAG_CLOG_ABORTED,)) + _U32.pack(len(xids)) + struct.pack(f">{len(xids)}I", *xids)
    if isinstance(value, MultixactOffsetCreate):
        return bytes((TAG_MULTIXACT_OFFSET,)) + _MX_OFFSET.pack(value.mid, value.moff)
    if isinstance(value, MultixactMembersCreate):
        flat = b"".join(struct.pack(">IB", xid, status) for xid, status in value.members)
        return bytes((TAG_MULTIXACT_MEMBERS,)) + _MX_OFFSET.pack(value.moff, len(value.members)) + flat
    if isinstance(value, TruncateVisibilityMap):
        return bytes((TAG_TRUNCATE_VM,)) + _TRUNC_VM.pack(value.trunc_byte, value.trunc_offs)
    if isinstance(value, TestRecord):
        app = value.append.encode()
        only = value.only_if.encode() if value.only_if is not None else b""
        flags = (
            (1 if value.clear else 0)
            | (2 if value.will_init else 0)
            | (4 if value.only_if is not None else 0)
        )
        return bytes((TAG_TEST,)) + _TEST_HDR.pack(flags, len(app), len(only)) + app + only
    raise TypeError(f"not a storage value: {value!r}")


def _corrupt(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"corrupt value: {what}", sqlstate=DATA_CORRUPTED)


def _exact(buf: memoryview, st: struct.Struct, what: str) -> tuple[int, ...]:
    if len(buf) != st.size:
        raise _corrupt(f"{what} needs {st.size} bytes, got {len(buf)}")
    return st.unpack(buf)


def _decode_image(body: memoryview) -> Value:
    return Image(bytes(body))


def _decode_postgres(body: memoryview) -> Value:
    if not body or body[0] > 1:
        raise _corrupt("bad will_init flag of a PostgreSQL record")
    return PostgresRecord(bool(body[0]), bytes(body[1:]))


def _decode_clear_vm(body: memoryview) -> Value:
    new, old, flags = _exact(body, _CLEAR_VM, "ClearVisibilityMapFlags")
    return ClearVisibilityMapFlags(None if new == _NO_BLKNO else new, None if old == _NO_BLKNO else old, flags)


def _decode_clog_committed(body: memoryview) -> Value:
    if len(body) < 12:
        raise _corrupt("truncated ClogSetCommitted")
    (ts,) = _CLOG_TS.unpack_from(body)
    (n,) = _U32.unpack_from(body, 8)
    if len(body) != 12 + 4 * n:
        raise _corrupt(f"ClogSetCommitted with {n} xids has {len(body)} bytes")
    return ClogSetCommitted(struct.unpack_from(f">{n}I", body, 12), ts)


def _decode_clog_aborted(body: memoryview) -> Value:
    if len(body) < 4:
        raise _corrupt("truncated ClogSetAborted")
    (n,) = _U32.unpack_from(body)
    if len(body) != 4 + 4 * n:
        raise _corrupt(f"ClogSetAborted with {n} xids has {len(body)} bytes")
    return ClogSetAborted(struct.unpack_from(f">{n}I", body, 4))


def _decode_mx_offset(body: memoryview) -> Value:
    mid, moff = _exact(body, _MX_OFFSET, "MultixactOffsetCreate")
    return MultixactOffsetCreate(mid, moff)


def _decode_mx_members(body: memoryview) -> Value:
    if len(body) < 8:
        raise _corrupt("truncated MultixactMembersCreate")
    moff, n = _MX_OFFSET.unpack_from(body)
    if len(body) != 8 + 5 * n:
        raise _corrupt(f"MultixactMembersCreate with {n} members has {len(body)} bytes")
    members = tuple((xid, status) for xid, status in struct.iter_unpack(">IB", body[8:]))
    return MultixactMembersCreate(moff, members)


def _decode_truncate_vm(body: memoryview) -> Value:
    trunc_byte, trunc_offs = _exact(body, _TRUNC_VM, "TruncateVisibilityMap")
    return TruncateVisibilityMap(trunc_byte, trunc_offs)


_TEST_TEXT = _TEST_HDR.size
# A decoded Test record is built through its slot descriptors: what the frozen attrs
# ``__init__`` does (it has no validators or converters), at a third less cost per record.
_new_object = object.__new__


def _slot_setter(cls: type, name: str) -> Callable[[object, object], None]:
    setter: Callable[[object, object], None] = cls.__dict__[name].__set__
    return setter


_set_append = _slot_setter(TestRecord, "append")
_set_clear = _slot_setter(TestRecord, "clear")
_set_will_init = _slot_setter(TestRecord, "will_init")
_set_only_if = _slot_setter(TestRecord, "only_if")
_BOOLS = (False, True)
assert [a.name for a in attrs.fields(TestRecord)] == ["append", "clear", "will_init", "only_if"]


def _decode_test(body: memoryview) -> Value:
    n = len(body)
    if n < _TEST_TEXT:
        raise _corrupt("truncated Test record")
    flags, n_app, n_only = _TEST_HDR.unpack_from(body)
    if flags & ~7 or n != _TEST_TEXT + n_app + n_only:
        raise _corrupt("malformed Test record")
    if not flags & 4 and n_only:
        raise _corrupt("Test record has only_if bytes without the flag")
    end = _TEST_TEXT + n_app
    try:
        # str() of a memoryview slice decodes in place: no intermediate bytes copy
        app = str(body[_TEST_TEXT:end], "utf-8")
        only = str(body[end:], "utf-8") if flags & 4 else None
    except UnicodeDecodeError:
        raise _corrupt("Test record text is not UTF-8") from None
    record = _new_object(TestRecord)
    _set_append(record, app)
    _set_clear(record, _BOOLS[flags & 1])
    _set_will_init(record, _BOOLS[(flags >> 1) & 1])
    _set_only_if(record, only)
    return record


# indexed by tag: one lookup instead of a chain of comparisons per value (the vectored read
# path indexes it directly: see ``execute_reads``)
VALUE_DECODERS: Final = (
    _decode_image,
    _decode_postgres,
    _decode_clear_vm,
    _decode_clog_committed,
    _decode_clog_aborted,
    _decode_mx_offset,
    _decode_mx_members,
    _decode_truncate_vm,
    _decode_test,
)
assert len(VALUE_DECODERS) == TAG_TEST + 1


def decode_value(blob: bytes | bytearray | memoryview) -> Value:
    """Parse a value encoded by ``encode_value``."""
    buf = blob if type(blob) is memoryview else memoryview(blob)
    if not buf:
        raise _corrupt("empty blob")
    tag = buf[0]
    if tag >= len(VALUE_DECODERS):
        raise _corrupt(f"unknown value tag {tag}")
    return VALUE_DECODERS[tag](buf[1:])


def value_will_init(encoded: bytes | bytearray | memoryview) -> bool:
    """``will_init`` of an encoded value without decoding all of it (used by writers)."""
    if not encoded:
        raise _corrupt("empty value")
    tag = encoded[0]
    if tag == TAG_IMAGE:
        return True
    if tag == TAG_POSTGRES:
        return len(encoded) > 1 and encoded[1] == 1
    if tag == TAG_TEST:
        return len(encoded) > 1 and bool(encoded[1] & 2)
    return False
