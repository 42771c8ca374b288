"""GIN posting lists and posting-leaf recompression, without PostgreSQL.

- segments round trip (encode, decode), also when ``maxsize`` cuts the list short, and the
  varbyte bytes are those of the format (a hand-computed segment);
- ``recompress`` applied to a page of random segments and a random list of actions (in the
  order and with the segment numbers the primary's ``computeLeafRecompressWALData`` writes)
  gives the segments a plain model of the actions predicts;
- truncated or garbled action lists and pages raise ``RedoError``, never IndexError or a page.
"""

from __future__ import annotations

import struct
from itertools import accumulate, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from pageserver.walredo.gin import GIN_COMPRESSED, GIN_DATA, GIN_LEAF, gin_init_page
from pageserver.walredo.gin_posting import (
    LEAF_DATA_START,
    SEGMENT_ADDITEMS,
    SEGMENT_DELETE,
    SEGMENT_INSERT,
    SEGMENT_REPLACE,
    append_to_segment,
    apply_actions,
    decode_segment,
    encode_segment,
    int_to_tid,
    merge_items,
    parse_actions,
    recompress,
    split_segments,
    tids_to_ints,
)

# TIDs as block << 11 | offset with offset 1..291 (MaxHeapTuplesPerPage)
tid_ints = st.builds(lambda b, o: (b << 11) | o, st.integers(0, 2**32 - 2), st.integers(1, 291))
sorted_tids = st.lists(tid_ints, min_size=1, max_size=300, unique=True).map(sorted)


@settings(max_examples=150, deadline=None)
@given(sorted_tids)
def test_segment_round_trip(items: list[int]) -> None:
    seg, packed = encode_segment(items)
    assert packed == len(items)
    assert len(seg) % 2 == 0
    assert decode_segment(seg, 0, len(seg)) == items
    assert split_segments(seg, 0, len(seg)) == [(0, len(seg))]


@settings(max_examples=200, deadline=None)
@given(sorted_tids, st.integers(8, 400))
def test_segment_cut_short_by_maxsize(items: list[int], maxsize: int) -> None:
    seg, packed = encode_segment(items, maxsize)
    assert len(seg) <= maxsize + 1  # the padding byte may follow
    assert decode_segment(seg, 0, len(seg)) == items[:packed]
    if packed < len(items):  # the next item would not have fit
        longer, _ = encode_segment(items[: packed + 1])
        assert 8 + struct.unpack_from("<H", longer, 6)[0] > maxsize


@settings(max_examples=150, deadline=None)
@given(sorted_tids, st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_append_equals_reencoding(items: list[int], gaps: list[int]) -> None:
    """Adding items past a segment's last one keeps its bytes and appends the new gaps: the
    same segment ginCompressPostingList makes of the merged list."""
    seg, _ = encode_segment(items)
    more = list(accumulate(gaps, initial=items[-1]))[1:]
    assert append_to_segment(seg, 0, len(seg), more) == encode_segment([*items, *more])[0]
    assert append_to_segment(seg, 0, len(seg), [items[-1], *more]) is None  # not all past the end


def test_segment_bytes_are_the_format() -> None:
    """(1,1), (1,2), (2,1), (2**20, 5), (2**20, 6): first raw, then gaps 1, 2047, a 5-byte
    varbyte and 1; nine bytes, so a zero padding byte follows."""
    items = [(1 << 11) | 1, (1 << 11) | 2, (2 << 11) | 1, (2**20 << 11) | 5, (2**20 << 11) | 6]
    seg, _ = encode_segment(items)
    gap = items[3] - items[2]
    varbyte = bytes(
        [0x80 | (gap & 0x7F), 0x80 | ((gap >> 7) & 0x7F), 0x80 | ((gap >> 14) & 0x7F),
         0x80 | ((gap >> 21) & 0x7F), gap >> 28]
    )
    body = b"\x01" + bytes([0x80 | (2047 & 0x7F), 2047 >> 7]) + varbyte + b"\x01"
    assert seg == struct.pack("<HHHH", 0, 1, 1, len(body)) + body + b"\x00"
    assert decode_segment(seg, 0, len(seg)) == items


def test_seven_byte_varbyte() -> None:
    """A gap of 2**42 or more takes the 7th byte whole (no continuation bit)."""
    items = [1, 1 + (1 << 43) + 5]
    seg, _ = encode_segment(items)
    assert struct.unpack_from("<H", seg, 6)[0] == 7
    assert decode_segment(seg, 0, len(seg)) == items


# --- recompression against a model ------------------------------------------------------


def _leaf_page(segments: list[list[int]]) -> bytearray:
    page = bytearray(bp.BLCKSZ)
    gin_init_page(page, GIN_DATA | GIN_LEAF | GIN_COMPRESSED)
    data = b"".join(encode_segment(s)[0] for s in segments)
    page[LEAF_DATA_START : LEAF_DATA_START + len(data)] = data
    bp.set_lower(page, LEAF_DATA_START + len(data))
    return page


def _page_segments(page: bytearray) -> list[list[int]]:
    lower = bp.get_lower(page)
    return [decode_segment(page, p, p + n) for p, n in split_segments(page, LEAF_DATA_START, lower)]


@st.composite
def leaf_and_actions(draw: st.DrawFn) -> tuple[list[list[int]], bytes, list[list[int]]]:
    """Old segments, the WAL action list, and the segments the actions must produce.

    Like computeLeafRecompressWALData: one decision per old segment in order (unmodified,
    delete, replace, add items), new segments inserted before any old one or at the end; the
    segno counter advances on everything but INSERT."""
    items = draw(st.lists(tid_ints, min_size=1, max_size=400, unique=True).map(sorted))
    nseg = draw(st.integers(1, min(8, len(items))))
    cuts = sorted(draw(st.lists(st.integers(1, len(items) - 1), max_size=nseg - 1, unique=True))) if len(items) > 1 else []
    bounds = [0, *cuts, len(items)]
    old = [items[a:b] for a, b in pairwise(bounds)]
    wal = bytearray()
    nactions = 0
    model: list[list[int]] = []

    def fresh() -> list[int]:
        return draw(st.lists(tid_ints, min_size=1, max_size=40, unique=True).map(sorted))

    for segno, seg in enumerate([*old, None]):
        for _ in range(draw(st.integers(0, 1))):  # a new segment before this one
            new = fresh()
            wal += bytes([segno, SEGMENT_INSERT]) + encode_segment(new)[0]
            nactions += 1
            model.append(new)
        if seg is None:
            break
        kind = draw(st.sampled_from(["keep", "delete", "replace", "additems"]))
        if kind == "keep":
            model.append(seg)
        elif kind == "delete":
            wal += bytes([segno, SEGMENT_DELETE])
            nactions += 1
        elif kind == "replace":
            new = fresh()
            wal += bytes([segno, SEGMENT_REPLACE]) + encode_segment(new)[0]
            nactions += 1
            model.append(new)
        else:
            add = sorted(set(fresh()) - set(seg))
            wal += bytes([segno, SEGMENT_ADDITEMS]) + struct.pack("<H", len(add))
            wal += b"".join(int_to_tid(v) for v in add)
            nactions += 1
            model.append(sorted([*seg, *add]))
    return old, struct.pack("<H", nactions) + bytes(wal), model


@settings(max_examples=150, deadline=None)
@given(leaf_and_actions())
def test_recompress_equals_model(case: tuple[list[list[int]], bytes, list[list[int]]]) -> None:
    old, actions, model = case
    page = _leaf_page(old)
    before = bytes(page)
    recompress(page, actions)
    assert _page_segments(page) == model
    # exactly the bytes the segments encode to, from 32 on; header and special unchanged
    data = b"".join(encode_segment(s)[0] for s in model)
    assert page[LEAF_DATA_START : LEAF_DATA_START + len(data)] == data
    assert bp.get_lower(page) == LEAF_DATA_START + len(data)
    assert page[bp.BLCKSZ - 8 :] == before[bp.BLCKSZ - 8 :]


@settings(max_examples=150, deadline=None)
@given(st.lists(sorted_tids, min_size=1, max_size=6), st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.booleans())
def test_in_place_append_equals_the_general_path(segments: list[list[int]], gaps: list[int], past_end: bool) -> None:
    """A single ADDITEMS on the last segment (the in-place path) writes what the general
    action walk writes, whether or not the items follow the segment's end."""
    last = segments[-1]
    start = last[-1] if past_end else last[0] - 1
    base = max(start, 0)
    add = sorted(v for v in set(accumulate(gaps, initial=base)) - {base} - set(last) if v < 0xFFFF_FFFF << 11)
    if not add:
        return
    data = struct.pack("<HBBH", 1, len(segments) - 1, SEGMENT_ADDITEMS, len(add)) + b"".join(int_to_tid(v) for v in add)
    page = _leaf_page(segments)
    recompress(page, data)
    old = _leaf_page(segments)
    new = apply_actions(old[LEAF_DATA_START : bp.get_lower(old)], parse_actions(data))
    assert page[LEAF_DATA_START : bp.get_lower(page)] == new
    assert _page_segments(page)[-1] == sorted({*last, *add})


def test_merge_items() -> None:
    assert merge_items([1, 2], [3]) == [1, 2, 3]
    assert merge_items([5, 9], [1, 2]) == [1, 2, 5, 9]
    assert merge_items([1, 4, 9], [2, 4, 10]) == [1, 2, 4, 9, 10]


def test_pre_94_uncompressed_leaf_is_converted() -> None:
    """A leaf of raw ItemPointers (maxoff of them, COMPRESSED clear) becomes one segment."""
    items = [(7 << 11) | o for o in range(1, 40)]
    page = bytearray(bp.BLCKSZ)
    gin_init_page(page, GIN_DATA | GIN_LEAF)
    raw = b"".join(int_to_tid(v) for v in items)
    page[LEAF_DATA_START : LEAF_DATA_START + len(raw)] = raw
    struct.pack_into("<H", page, bp.BLCKSZ - 4, len(items))
    bp.set_lower(page, LEAF_DATA_START + len(raw))
    add = (8 << 11) | 1
    recompress(page, struct.pack("<HBBH", 1, 0, SEGMENT_ADDITEMS, 1) + int_to_tid(add))
    assert _page_segments(page) == [[*items, add]]
    flags, maxoff = struct.unpack_from("<H", page, bp.BLCKSZ - 2)[0], struct.unpack_from("<H", page, bp.BLCKSZ - 4)[0]
    assert flags & GIN_COMPRESSED and maxoff == 0


# --- hostile input ------------------------------------------------------------------------


def test_truncated_and_garbled_actions_raise() -> None:
    page = _leaf_page([[(1 << 11) | 1, (1 << 11) | 2], [(5 << 11) | 1]])
    seg, _ = encode_segment([(3 << 11) | 1])
    good = struct.pack("<H", 1) + bytes([1, SEGMENT_REPLACE]) + seg
    copy = bytearray(page)
    recompress(copy, good)
    bad = [
        b"",  # no count
        good[:-1],  # segment cut
        good[:3],  # action cut
        struct.pack("<H", 2) + good[2:],  # count says more
        good + b"\x00",  # trailing byte
        struct.pack("<H", 1) + bytes([0, 9]),  # unknown action
        struct.pack("<H", 1) + bytes([5, SEGMENT_DELETE]),  # past the last segment
        struct.pack("<H", 2) + bytes([1, SEGMENT_DELETE, 0, SEGMENT_DELETE]),  # going back
        struct.pack("<HBBH", 1, 0, SEGMENT_ADDITEMS, 3) + int_to_tid(9),  # items cut
        struct.pack("<HBBH", 1, 0, SEGMENT_ADDITEMS, 1) + struct.pack("<HHH", 0, 1, 4000),  # offset > 11 bits
        struct.pack("<HBBH", 1, 0, SEGMENT_ADDITEMS, 2) + int_to_tid(9) + int_to_tid(9),  # not ascending
    ]
    for data in bad:
        p = bytearray(page)
        with pytest.raises(RedoError):
            recompress(p, data)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 40))
def test_random_bytes_never_crash(data: bytes, garble_at: int) -> None:
    """Any action bytes on any (possibly garbled) page: RedoError or a page whose posting data
    stays inside the page; never another exception."""
    page = _leaf_page([[(1 << 11) | 1, (1 << 11) | 9], [(4 << 11) | 2, (9 << 11) | 3]])
    page[LEAF_DATA_START + garble_at] ^= 0xFF
    try:
        recompress(page, data)
    except RedoError:
        return
    assert LEAF_DATA_START <= bp.get_lower(page) <= bp.BLCKSZ - 8


def test_tids_to_ints_rejects_wide_offsets() -> None:
    with pytest.raises(RedoError):
        tids_to_ints(struct.pack("<HHH", 0, 1, 2048), 0, 1)
