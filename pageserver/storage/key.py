"""Neon's 18-byte storage key, key ranges and key spaces.

A ``Key`` is 18 bytes: field1 u8, field2 u32, field3 u32, field4 u32, field5 u8, field6 u32, all
big-endian, so byte order equals field-tuple order (storage.md §1.1). Keys are plain ``bytes``
at run time (a ``NewType``): comparing, hashing and sorting them costs what it costs for bytes,
and they go straight into layer-file indexes without conversion.

Ranges are half-open ``[start, end)``. A ``KeySpace`` is a sorted list of disjoint, non-touching
ranges; the vectored read path routes sub-key-spaces to layers and subtracts completed keys.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import NewType

import attrs

# Fork numbers live with the WAL record format; re-exported here for key users.
from protocol.wal.record import FSM_FORKNUM as FSM_FORKNUM
from protocol.wal.record import INIT_FORKNUM as INIT_FORKNUM
from protocol.wal.record import MAIN_FORKNUM as MAIN_FORKNUM
from protocol.wal.record import VISIBILITYMAP_FORKNUM as VISIBILITYMAP_FORKNUM

Key = NewType("Key", bytes)

KEY_SIZE = 18
_KEY = struct.Struct(">BIIIBI")
# ``_KEY.pack`` typed as returning a Key: calling the NewType costs a Python-level call per
# key, and rel_block_key runs once per block of every ingested WAL record.
_pack_key: Callable[[int, int, int, int, int, int], Key] = _KEY.pack  # type: ignore[assignment]

KEY_MIN = Key(b"\x00" * KEY_SIZE)
KEY_MAX = Key(b"\xff" * KEY_SIZE)
_KEY_INT_MAX = (1 << (8 * KEY_SIZE)) - 1

# field1 sections (storage.md §1.2)
SECTION_REL = 0x00
SECTION_SLRU = 0x01
SECTION_TWOPHASE = 0x02
SECTION_MISC = 0x03

SLRU_CLOG = 0
SLRU_MULTIXACT_MEMBERS = 1
SLRU_MULTIXACT_OFFSETS = 2
SLRU_COMMIT_TS = 3  # pg_commit_ts (pagestore's own: Neon's pagestream SlruKind stops at 2)

_SIZE_BLKNUM = 0xFFFF_FFFF


def make_key(f1: int, f2: int, f3: int, f4: int, f5: int, f6: int) -> Key:
    return _pack_key(f1, f2, f3, f4, f5, f6)


def key_fields(key: bytes) -> tuple[int, int, int, int, int, int]:
    if len(key) != KEY_SIZE:
        raise ValueError(f"a key has {KEY_SIZE} bytes, got {len(key)}")
    f1, f2, f3, f4, f5, f6 = _KEY.unpack(key)
    return f1, f2, f3, f4, f5, f6


def key_to_int(key: bytes) -> int:
    return int.from_bytes(key, "big")


def key_from_int(value: int) -> Key:
    return Key(value.to_bytes(KEY_SIZE, "big"))


def key_next(key: bytes) -> Key:
    """The smallest key greater than ``key`` (field6 +1 with carry: the 144-bit successor)."""
    value = int.from_bytes(key, "big")
    if value >= _KEY_INT_MAX:
        raise OverflowError("KEY_MAX has no successor")
    return Key((value + 1).to_bytes(KEY_SIZE, "big"))


def key_add(key: bytes, n: int) -> Key:
    return key_from_int(int.from_bytes(key, "big") + n)


def key_hex(key: bytes) -> str:
    """Neon's text form: 36 upper-case hex digits."""
    return key.hex().upper()


def key_parse_hex(text: str) -> Key:
    raw = bytes.fromhex(text)
    if len(raw) != KEY_SIZE:
        raise ValueError(f"invalid key {text!r}: expected {2 * KEY_SIZE} hex digits")
    return Key(raw)


# --- constructors for the key-space layout (storage.md §1.2) -------------------------------


def rel_block_key(spcnode: int, dbnode: int, relnode: int, forknum: int, blkno: int) -> Key:
    return _pack_key(SECTION_REL, spcnode, dbnode, relnode, forknum, blkno)


def rel_size_key(spcnode: int, dbnode: int, relnode: int, forknum: int) -> Key:
    return make_key(SECTION_REL, spcnode, dbnode, relnode, forknum, _SIZE_BLKNUM)


def rel_key_range(spcnode: int, dbnode: int, relnode: int, forknum: int) -> KeyRange:
    """All keys of one relation fork: its blocks and its size key."""
    return KeyRange(
        make_key(SECTION_REL, spcnode, dbnode, relnode, forknum, 0),
        make_key(SECTION_REL, spcnode, dbnode, relnode, forknum + 1, 0),
    )


def rel_dir_key(spcnode: int, dbnode: int) -> Key:
    return make_key(SECTION_REL, spcnode, dbnode, 0, 0, 1)


def relmap_file_key(spcnode: int, dbnode: int) -> Key:
    return make_key(SECTION_REL, spcnode, dbnode, 0, 0, 0)


DBDIR_KEY = make_key(SECTION_REL, 0, 0, 0, 0, 0)


def slru_dir_key(kind: int) -> Key:
    return make_key(SECTION_SLRU, kind, 0, 0, 0, 0)


def slru_block_key(kind: int, segno: int, blkno: int) -> Key:
    return make_key(SECTION_SLRU, kind, 1, segno, 0, blkno)


def slru_segment_size_key(kind: int, segno: int) -> Key:
    return make_key(SECTION_SLRU, kind, 1, segno, 0, _SIZE_BLKNUM)


TWOPHASEDIR_KEY = make_key(SECTION_TWOPHASE, 0, 0, 0, 0, 0)


def twophase_file_key(xid: int) -> Key:
    return make_key(SECTION_TWOPHASE, 0, 0, 0, 0, xid)


CONTROLFILE_KEY = make_key(SECTION_MISC, 0, 0, 0, 0, 0)
CHECKPOINT_KEY = make_key(SECTION_MISC, 0, 0, 0, 0, 1)
AUX_FILES_KEY = make_key(SECTION_MISC, 0, 0, 0, 0, 2)


def is_rel_block_key(key: bytes) -> bool:
    f1, _f2, _f3, f4, _f5, f6 = key_fields(key)
    return f1 == SECTION_REL and f4 != 0 and f6 != _SIZE_BLKNUM


def is_inherited_key(key: bytes) -> bool:
    """Branches inherit every key except the aux-files key (storage.md §1.2)."""
    return key != AUX_FILES_KEY


# --- ranges and key spaces ----------------------------------------------------------------


@attrs.frozen(order=True)
class KeyRange:
    """Half-open ``[start, end)``."""

    start: Key
    end: Key

    @classmethod
    def single(cls, key: Key) -> KeyRange:
        return cls(key, key_next(key))

    @classmethod
    def full(cls) -> KeyRange:
        return cls(KEY_MIN, KEY_MAX)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.start <= key < self.end

    def is_empty(self) -> bool:
        return self.start >= self.end

    def overlaps(self, other: KeyRange) -> bool:
        return self.start < other.end and other.start < self.end

    def intersect(self, other: KeyRange) -> KeyRange:
        return KeyRange(max(self.start, other.start), min(self.end, other.end))

    def covers(self, other: KeyRange) -> bool:
        return self.start <= other.start and other.end <= self.end

    def key_count(self) -> int:
        return max(0, key_to_int(self.end) - key_to_int(self.start))

    def iter_keys(self) -> Iterator[Key]:
        start, end = key_to_int(self.start), key_to_int(self.end)
        for value in range(start, end):
            yield key_from_int(value)

    def __str__(self) -> str:
        return f"{key_hex(self.start)}-{key_hex(self.end)}"


@attrs.frozen
class KeySpace:
    """Sorted, disjoint, non-touching ranges (normalized by every constructor)."""

    ranges: tuple[KeyRange, ...] = ()

    @classmethod
    def from_ranges(cls, ranges: Iterable[KeyRange]) -> KeySpace:
        merged: list[KeyRange] = []
        for r in sorted(r for r in ranges if not r.is_empty()):
            if merged and r.start <= merged[-1].end:
                last = merged[-1]
                if r.end > last.end:
                    merged[-1] = KeyRange(last.start, r.end)
            else:
                merged.append(r)
        return cls(tuple(merged))

    @classmethod
    def from_keys(cls, keys: Iterable[Key]) -> KeySpace:
        return cls.from_ranges(KeyRange.single(k) for k in keys)

    @classmethod
    def single(cls, r: KeyRange) -> KeySpace:
        return cls((r,) if not r.is_empty() else ())

    def is_empty(self) -> bool:
        return not self.ranges

    def merge(self, other: KeySpace) -> KeySpace:
        if not other.ranges:
            return self
        if not self.ranges:
            return other
        return KeySpace.from_ranges((*self.ranges, *other.ranges))

    def subtract(self, other: KeySpace) -> KeySpace:
        if not other.ranges or not self.ranges:
            return self
        out: list[KeyRange] = []
        holes = other.ranges
        starts = [h.start for h in holes]
        for r in self.ranges:
            cur = r.start
            i = max(0, bisect.bisect_right(starts, r.start) - 1)
            while i < len(holes) and holes[i].start < r.end:
                hole = holes[i]
                if hole.end > cur:
                    if hole.start > cur:
                        out.append(KeyRange(cur, hole.start))
                    cur = max(cur, hole.end)
                i += 1
            if cur < r.end:
                out.append(KeyRange(cur, r.end))
        return KeySpace(tuple(out))

    def intersect_range(self, r: KeyRange) -> KeySpace:
        out = [x.intersect(r) for x in self.ranges if x.overlaps(r)]
        return KeySpace(tuple(out))

    def contains(self, key: bytes) -> bool:
        i = bisect.bisect_right(self.ranges, key, key=lambda x: x.start) - 1
        return i >= 0 and key < self.ranges[i].end

    def key_count(self) -> int:
        return sum(r.key_count() for r in self.ranges)

    def iter_keys(self) -> Iterator[Key]:
        for r in self.ranges:
            yield from r.iter_keys()

    def start(self) -> Key | None:
        return self.ranges[0].start if self.ranges else None
