"""GIN posting lists (``ginpostinglist.c``) and the recompression of posting-tree leaves.

A posting-tree leaf page holds, from offset 32 to ``pd_lower``, a run of *segments*
(GinPostingList): the first heap TID raw (6 bytes), ``nbytes`` (u16), then the gaps to each
following TID as varbyte numbers, padded to an even size. A TID is handled here as the integer
``block << 11 | offset`` (``itemptr_to_uint64``), which orders TIDs as PostgreSQL compares them
and makes the gaps small.

``recompress`` replays ``ginRedoRecompress``: the WAL of a leaf insert or a leaf vacuum does
not log the new page but a list of actions on the old page's segments (delete one, insert a new
one before it, replace it, or add items to it and re-encode). Encoding is deterministic, so an
ADDITEMS action rebuilt here yields the primary's bytes. PostgreSQL writes the resulting
segments one after another from offset 32 and leaves the bytes past the new end as they were;
this module writes the same concatenation, so the page equals the primary's byte for byte up to
``pd_lower`` (the rest is masked as free space).

Every length and offset read from a page or a record is checked: a truncated or garbled input
raises ``RedoError``, never a partial page.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import accumulate, pairwise

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError

BLCKSZ = 8192
OFFSET_BITS = 11  # MaxHeapTuplesPerPageBits
OFFSET_MASK = (1 << OFFSET_BITS) - 1
SEGMENT_HEADER = 8  # ItemPointerData first + uint16 nbytes
MAX_BYTES_PER_INTEGER = 7
# posting data of a leaf page: after the header (24) and the right bound (MAXALIGN(6) = 8)
LEAF_DATA_START = 32
GIN_OPAQUE_SIZE = 8
LEAF_DATA_MAX = BLCKSZ - GIN_OPAQUE_SIZE - LEAF_DATA_START  # GinDataPageMaxDataSize
GIN_COMPRESSED = 0x80

# action types of ginxlogRecompressDataLeaf (ginxlog.h)
SEGMENT_UNMODIFIED = 0
SEGMENT_DELETE = 1
SEGMENT_INSERT = 2
SEGMENT_REPLACE = 3
SEGMENT_ADDITEMS = 4

_TID = struct.Struct("<HHH")  # bi_hi, bi_lo, posid
_U16 = struct.Struct("<H")
_SEG_HEAD = struct.Struct("<HHHH")  # first (bi_hi, bi_lo, posid), nbytes


def tid_to_int(buf: bytes | bytearray | memoryview, pos: int) -> int:
    hi, lo, off = _TID.unpack_from(buf, pos)
    v: int = (((hi << 16) | lo) << OFFSET_BITS) | off
    return v


def int_to_tid(v: int) -> bytes:
    blk = v >> OFFSET_BITS
    return _TID.pack(blk >> 16, blk & 0xFFFF, v & OFFSET_MASK)


def tids_to_ints(buf: bytes | bytearray | memoryview, pos: int, n: int) -> list[int]:
    """``n`` raw ItemPointers at ``pos`` as integers (a TID's offset must fit in 11 bits)."""
    raw = struct.unpack_from(f"<{3 * n}H", buf, pos)
    out = []
    for i in range(0, 3 * n, 3):
        off = raw[i + 2]
        if off > OFFSET_MASK:
            raise RedoError(f"item pointer offset {off} does not fit a posting list")
        out.append((((raw[i] << 16) | raw[i + 1]) << OFFSET_BITS) | off)
    return out


# --- one segment --------------------------------------------------------------------------


# Gaps between neighbouring TIDs are mostly single varbyte bytes (below 0x80), so the codec
# handles runs of those at C speed and only the few multi-byte numbers one by one: they are
# found as runs of continuation bytes (0x80 set), marked 1 by _MARK.
_MARK = bytes(int(b > 0x7F) for b in range(256))
_HIGH_BYTES = bytes(range(0x80, 0x100))


def _multi_spans(body: bytes, pos: int) -> list[tuple[int, int]]:
    """(start, end) of each varbyte number of two or more bytes in ``body``: continuation
    bytes then a final byte below 0x80, or six continuation bytes and a 7th taken whole."""
    out = []
    n = len(body)
    mark = body.translate(_MARK)
    s = mark.find(1)
    while s >= 0:
        e = mark.find(0, s)  # the run of continuation bytes is [s, e)
        if e < 0:
            e = n
        while s < e:
            end = s + 7 if e - s >= 6 else e + 1
            if end > n:
                raise RedoError(f"varbyte number runs past its posting list at {pos}")
            out.append((s, end))
            s = end
        s = mark.find(1, s)
    return out


def _varbyte_value(raw: bytes) -> int:
    if len(raw) == 2:  # gaps across one heap page: the usual multi-byte number
        return (raw[0] & 0x7F) | (raw[1] << 7)
    v = 0
    for i, c in enumerate(raw):
        v |= (c << 42) if i == 6 else (c & 0x7F) << (7 * i)
    return v


def _varbytes(d: int) -> bytes:
    out = bytearray()
    while d > 0x7F:
        out.append(0x80 | (d & 0x7F))
        d >>= 7
    out.append(d)
    return bytes(out)


def _encode_gaps(deltas: Sequence[int]) -> bytes:
    """The varbyte encoding of ``deltas`` (all > 0), with no size limit."""
    big = [i for i, d in enumerate(deltas) if d > 0x7F]
    if not big:
        return bytes(deltas)
    out = bytearray()
    prev = 0
    for i in big:
        out += bytes(deltas[prev:i])
        out += _varbytes(deltas[i])
        prev = i + 1
    out += bytes(deltas[prev:])
    return bytes(out)


def _decode_gaps(body: bytes, pos: int) -> list[int]:
    """The gaps a segment's varbyte bytes encode (``pos``: where, for the error)."""
    gaps: list[int] = []
    at = 0
    for s, e in _multi_spans(body, pos):
        gaps.extend(body[at:s])
        gaps.append(_varbyte_value(body[s:e]))
        at = e
    gaps.extend(body[at:])
    return gaps


def _segment(first: int, body: bytes) -> bytes:
    nbytes = len(body)
    head = int_to_tid(first) + _U16.pack(nbytes)
    return head + body + b"\0" if nbytes & 1 else head + body


def encode_segment(items: Sequence[int], maxsize: int = BLCKSZ) -> tuple[bytes, int]:
    """ginCompressPostingList: a segment holding as many of ``items`` (sorted, distinct) as fit
    in ``maxsize`` bytes; returns (segment bytes, number of items packed)."""
    if not items:
        raise RedoError("an empty posting list cannot be encoded")
    room = maxsize - SEGMENT_HEADER
    deltas = [b - a for a, b in pairwise(items)]
    if deltas and min(deltas) <= 0:
        raise RedoError("posting list items are not strictly ascending")
    body = _encode_gaps(deltas)
    if len(body) <= room:
        return _segment(items[0], body), len(items)
    # too long: stop before the first item whose bytes would not fit
    used = 0
    packed = 1
    for d in deltas:
        n = len(_varbytes(d))
        if used + n > room:
            break
        used += n
        packed += 1
    return _segment(items[0], body[:used]), packed


def append_to_segment(buf: bytes | bytearray | memoryview, pos: int, end: int, items: Sequence[int]) -> bytes | None:
    """The segment at ``pos`` with ``items`` (sorted) added, when they all follow its last
    item: the old bytes stay, the new gaps follow (what re-encoding the merged list gives,
    without decoding it). None when they do not all follow."""
    if pos + SEGMENT_HEADER > end:
        raise RedoError(f"truncated posting list header at {pos}")
    hi, lo, off, nbytes = _SEG_HEAD.unpack_from(buf, pos)
    body_end = pos + SEGMENT_HEADER + nbytes
    if body_end + (nbytes & 1) > end:
        raise RedoError(f"posting list at {pos} runs past {end}")
    body = bytes(buf[pos + SEGMENT_HEADER : body_end])
    # the last item: the first plus every gap (the bytes' sum, corrected for multi-byte gaps)
    last = ((((hi << 16) | lo) << OFFSET_BITS) | off) + sum(body)
    if len(body.translate(None, _HIGH_BYTES)) != nbytes:
        for s, e in _multi_spans(body, pos):
            raw = body[s:e]
            last += _varbyte_value(raw) - sum(raw)
    if not items or items[0] <= last:
        return None
    if len(items) == 1:  # one new TID per heap row: the usual insert
        more = _varbytes(items[0] - last)
    else:
        deltas = [b - a for a, b in pairwise([last, *items])]
        if min(deltas) <= 0:
            raise RedoError("posting list items are not strictly ascending")
        more = _encode_gaps(deltas)
    n = nbytes + len(more)
    if n > BLCKSZ - SEGMENT_HEADER:
        return None
    head = bytes(buf[pos : pos + 6]) + _U16.pack(n)
    return head + body + more + b"\0" if n & 1 else head + body + more


def segment_size(buf: bytes | bytearray | memoryview, pos: int, end: int) -> int:
    """SizeOfGinPostingList of the segment at ``pos``, checked to end at or before ``end``."""
    if pos + SEGMENT_HEADER > end:
        raise RedoError(f"truncated posting list header at {pos}")
    nbytes: int = _U16.unpack_from(buf, pos + 6)[0]
    size = SEGMENT_HEADER + ((nbytes + 1) & ~1)
    if pos + size > end:
        raise RedoError(f"posting list at {pos} of {size} bytes runs past {end}")
    return size


def decode_segment(buf: bytes | bytearray | memoryview, pos: int, end: int) -> list[int]:
    """ginPostingListDecode of the segment at ``pos`` (bounded by ``end``)."""
    segment_size(buf, pos, end)
    nbytes = _U16.unpack_from(buf, pos + 6)[0]
    first = tid_to_int(buf, pos)
    body = bytes(buf[pos + SEGMENT_HEADER : pos + SEGMENT_HEADER + nbytes])
    dense = len(body.translate(None, _HIGH_BYTES)) == len(body)
    gaps = body if dense else _decode_gaps(body, pos)
    return list(accumulate(gaps, initial=first))


def split_segments(buf: bytes | bytearray | memoryview, start: int, end: int) -> list[tuple[int, int]]:
    """(offset, size) of each segment between ``start`` and ``end``."""
    out = []
    pos = start
    while pos < end:
        size = segment_size(buf, pos, end)
        out.append((pos, size))
        pos += size
    return out


def merge_items(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """ginMergeItemPointers: the sorted union of two sorted lists (duplicates kept once)."""
    if not a or not b or a[-1] < b[0]:
        return [*a, *b]
    if b[-1] < a[0]:
        return [*b, *a]
    return sorted(set(a).union(b))


# --- the recompression actions ------------------------------------------------------------


def parse_actions(data: bytes | bytearray | memoryview, pos: int = 0) -> list[tuple[int, int, bytes | list[int] | None]]:
    """The actions of a ginxlogRecompressDataLeaf at ``pos``: (segno, type, payload). The
    payload is a segment's bytes (INSERT, REPLACE), the items to add (ADDITEMS), or None."""
    end = len(data)
    if pos + 2 > end:
        raise RedoError("recompress data without an action count")
    (nactions,) = _U16.unpack_from(data, pos)
    pos += 2
    out: list[tuple[int, int, bytes | list[int] | None]] = []
    for _ in range(nactions):
        if pos + 2 > end:
            raise RedoError(f"recompress data truncated after {len(out)} of {nactions} actions")
        segno = data[pos]
        action = data[pos + 1]
        pos += 2
        payload: bytes | list[int] | None = None
        if action in (SEGMENT_INSERT, SEGMENT_REPLACE):
            size = segment_size(data, pos, end)
            payload = bytes(data[pos : pos + size])
            pos += size
        elif action == SEGMENT_ADDITEMS:
            if pos + 2 > end:
                raise RedoError("ADDITEMS action without an item count")
            (nitems,) = _U16.unpack_from(data, pos)
            pos += 2
            if pos + 6 * nitems > end:
                raise RedoError(f"ADDITEMS of {nitems} items truncated")
            payload = tids_to_ints(data, pos, nitems)
            pos += 6 * nitems
        elif action != SEGMENT_DELETE:
            raise RedoError(f"unexpected leaf action {action}")
        out.append((segno, action, payload))
    if pos != end:
        raise RedoError(f"{end - pos} bytes after the last recompress action")
    return out


def apply_actions(
    old: bytes | bytearray | memoryview, actions: Sequence[tuple[int, int, bytes | list[int] | None]]
) -> bytearray:
    """The new run of segments: ``old`` (the page's segments) changed by ``actions``."""
    end = len(old)
    out = bytearray()
    pos = 0
    kept = 0  # old[kept:pos] are unmodified segments not yet copied to out
    segno = 0
    unpack = _U16.unpack_from
    for a_segno, action, payload in actions:
        if a_segno < segno:
            raise RedoError(f"leaf action for segment {a_segno} after segment {segno}")
        while segno < a_segno:  # skip the unmodified segments before this one
            if pos + SEGMENT_HEADER > end:
                raise RedoError(f"leaf action names segment {a_segno}, the page has {segno}")
            pos += SEGMENT_HEADER + ((unpack(old, pos + 6)[0] + 1) & ~1)
            segno += 1
        if pos > end:
            raise RedoError(f"posting list before segment {segno} runs past {end}")
        out += old[kept:pos]
        if pos < end:
            segsize = segment_size(old, pos, end)
        elif action == SEGMENT_INSERT:
            segsize = 0
        else:
            raise RedoError(f"leaf action {action} past the last segment ({segno})")
        if action == SEGMENT_ADDITEMS:
            assert isinstance(payload, list)
            # items past the segment's end (the common case) extend its bytes; else merge
            seg_or_none = append_to_segment(old, pos, end, payload)
            if seg_or_none is None:
                merged = merge_items(payload, decode_segment(old, pos, end))
                seg, packed = encode_segment(merged)
                if packed != len(merged):
                    raise RedoError(f"{len(merged)} items do not fit one posting list")
            else:
                seg = seg_or_none
            out += seg
            pos += segsize
            segno += 1
        elif action == SEGMENT_DELETE:
            pos += segsize
            segno += 1
        elif action == SEGMENT_INSERT:
            assert isinstance(payload, bytes)
            out += payload
        else:  # REPLACE
            assert isinstance(payload, bytes)
            out += payload
            pos += segsize
            segno += 1
        kept = pos
    out += old[kept:]
    return out


def _append_in_place(page: bytearray, lower: int, action: tuple[int, int, bytes | list[int] | None]) -> bool:
    """The usual leaf insert: ADDITEMS to the last segment with items past its end. Its bytes
    grow where they are (what ``apply_actions`` would write, without copying the page's other
    segments out and back). False, having changed nothing, for any other case."""
    segno, _action, items = action
    assert isinstance(items, list)
    unpack = _U16.unpack_from
    pos = LEAF_DATA_START
    for _ in range(segno):
        if pos + SEGMENT_HEADER > lower:
            return False
        pos += SEGMENT_HEADER + ((unpack(page, pos + 6)[0] + 1) & ~1)
    if pos + SEGMENT_HEADER > lower or pos + segment_size(page, pos, lower) != lower:
        return False
    seg = append_to_segment(page, pos, lower, items)
    if seg is None or pos + len(seg) > LEAF_DATA_START + LEAF_DATA_MAX:
        return False
    page[pos : pos + len(seg)] = seg
    bp.set_lower(page, pos + len(seg))
    return True


def recompress(page: bytearray, data: bytes | bytearray | memoryview) -> None:
    """ginRedoRecompress on a posting-tree leaf page (special area at BLCKSZ - 8)."""
    actions = parse_actions(data)
    lower = bp.get_lower(page)
    maxoff_pos = BLCKSZ - GIN_OPAQUE_SIZE + 4
    flags = _U16.unpack_from(page, maxoff_pos + 2)[0]
    if not flags & GIN_COMPRESSED:
        # a pre-9.4 leaf: maxoff raw ItemPointers at 32 become one segment
        nitems = _U16.unpack_from(page, maxoff_pos)[0]
        if 6 * nitems > LEAF_DATA_MAX:
            raise RedoError(f"uncompressed leaf claims {nitems} items")
        items = tids_to_ints(page, LEAF_DATA_START, nitems)
        seg = encode_segment(items)[0] if items else b""
        page[LEAF_DATA_START : LEAF_DATA_START + len(seg)] = seg
        lower = LEAF_DATA_START + len(seg)
        _U16.pack_into(page, maxoff_pos + 2, flags | GIN_COMPRESSED)
        _U16.pack_into(page, maxoff_pos, 0)
    if not LEAF_DATA_START <= lower <= LEAF_DATA_START + LEAF_DATA_MAX:
        raise RedoError(f"posting leaf with pd_lower {lower}")
    if len(actions) == 1 and actions[0][1] == SEGMENT_ADDITEMS and _append_in_place(page, lower, actions[0]):
        return
    new = apply_actions(page[LEAF_DATA_START:lower], actions)
    if len(new) > LEAF_DATA_MAX:
        raise RedoError(f"recompressed leaf data of {len(new)} bytes does not fit the page")
    page[LEAF_DATA_START : LEAF_DATA_START + len(new)] = new
    bp.set_lower(page, LEAF_DATA_START + len(new))
