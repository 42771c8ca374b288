"""Unit and property tests of the bufpage primitives and the page masks."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from pageserver.walredo import bufpage as bp
from pageserver.walredo.mask import heap_mask, mask_lp_flags, mask_unused_space, masked


def _items(page: bytearray) -> list[bytes]:
    out = []
    for off in range(1, bp.max_offset(page) + 1):
        raw = bp.get_itemid(page, off)
        out.append(bytes(page[bp.lp_off(raw) : bp.lp_off(raw) + bp.lp_len(raw)]))
    return out


def _check_packed(page: bytearray) -> None:
    """Items with storage sit back to back from pd_special down, in line-pointer order."""
    pos = bp.get_special(page)
    for off in range(1, bp.max_offset(page) + 1):
        raw = bp.get_itemid(page, off)
        if bp.lp_len(raw):
            pos -= bp.maxalign(bp.lp_len(raw))
            assert bp.lp_off(raw) == pos
    assert bp.get_upper(page) == pos


def test_page_init_layout() -> None:
    page = bp.new_page(16)
    lsn_hi, lsn_lo, cks, flags, lower, upper, special, psv, prune = bp.PAGE_HEADER.unpack_from(page)
    assert (lower, upper, special, psv) == (24, 8176, 8176, 0x2004)
    assert (lsn_hi, lsn_lo, cks, flags, prune) == (0, 0, 0, 0, 0)
    assert page[24:] == bytes(8168)
    bp.page_set_lsn(page, 0x1_0000_0028)
    assert page[0:8] == struct.pack("<II", 1, 0x28)
    assert bp.page_get_lsn(page) == 0x1_0000_0028


def test_add_item_places_at_upper_and_copies_exact_size() -> None:
    page = bp.new_page(0)
    page[8192 - 16 : 8192] = b"\xee" * 16  # stale bytes where the item's padding will be
    assert bp.page_add_item(page, b"abcde", 1, overwrite=True, is_heap=True) == 1
    raw = bp.get_itemid(page, 1)
    assert (bp.lp_off(raw), bp.lp_flags(raw), bp.lp_len(raw)) == (8184, bp.LP_NORMAL, 5)
    assert page[8184:8192] == b"abcde\xee\xee\xee"  # padding keeps what was there
    assert bp.get_lower(page) == 28 and bp.get_upper(page) == 8184


def test_add_item_overwrite_refuses_used_slot_and_shuffle_moves_pointers() -> None:
    page = bp.new_page(16)
    for i in range(3):
        assert bp.page_add_item(page, bytes([i]) * 8, i + 1, overwrite=False, is_heap=False)
    assert bp.page_add_item(page, b"x" * 8, 2, overwrite=True, is_heap=False) == 0
    assert bp.page_add_item(page, b"n" * 8, 2, overwrite=False, is_heap=False) == 2
    assert _items(page) == [b"\x00" * 8, b"n" * 8, b"\x01" * 8, b"\x02" * 8]
    assert bp.page_add_item(page, b"z" * 8, 9, overwrite=False, is_heap=False) == 0  # past maxoff+1


def test_add_item_full_page() -> None:
    page = bp.new_page(0)
    big = b"q" * 4000
    assert bp.page_add_item(page, big, 1, overwrite=True, is_heap=True) == 1
    assert bp.page_add_item(page, big, 2, overwrite=True, is_heap=True) == 2
    assert bp.page_add_item(page, big, 3, overwrite=True, is_heap=True) == 0


def test_index_tuple_delete_moves_lower_tuples_up() -> None:
    page = bp.new_page(16)
    for i, size in enumerate([16, 24, 8]):
        bp.page_add_item(page, bytes([65 + i]) * size, i + 1, overwrite=False, is_heap=False)
    before = _items(page)
    bp.page_index_tuple_delete(page, 2)
    assert _items(page) == [before[0], before[2]]
    assert bp.get_upper(page) == bp.get_special(page) - 24


def test_multi_delete_small_uses_retail_delete_layout() -> None:
    """<= 2 items go through PageIndexTupleDelete: a different layout than compaction."""
    page = bp.new_page(16)
    for i, size in enumerate([8, 16, 24, 32]):
        bp.page_add_item(page, bytes([65 + i]) * size, 1, overwrite=False, is_heap=False)
    a, b = bytearray(page), bytearray(page)
    bp.page_index_multi_delete(a, [2])
    bp.page_index_tuple_delete(b, 2)
    assert a == b


def test_tuple_overwrite_grow_and_shrink() -> None:
    page = bp.new_page(16)
    for i in range(3):
        bp.page_add_item(page, bytes([65 + i]) * 16, i + 1, overwrite=False, is_heap=False)
    assert bp.page_index_tuple_overwrite(page, 2, b"Z" * 40)
    assert _items(page) == [b"A" * 16, b"Z" * 40, b"C" * 16]
    assert bp.page_index_tuple_overwrite(page, 2, b"y" * 8)
    assert _items(page) == [b"A" * 16, b"y" * 8, b"C" * 16]
    assert bp.get_upper(page) == bp.get_special(page) - 40


def test_delete_no_compact_keeps_offsets() -> None:
    page = bp.new_page(8)
    for i in range(3):
        bp.page_add_item(page, bytes([65 + i]) * 8, i + 1, overwrite=False, is_heap=False)
    bp.page_index_tuple_delete_no_compact(page, 2)
    assert bp.max_offset(page) == 3 and not bp.itemid_is_used(bp.get_itemid(page, 2))
    bp.page_index_tuple_delete_no_compact(page, 3)
    assert bp.max_offset(page) == 2


@given(
    sizes=st.lists(st.integers(1, 150), min_size=1, max_size=40),
    data=st.data(),
)
def test_multi_delete_keeps_survivors_in_order(sizes: list[int], data: st.DataObject) -> None:
    page = bp.new_page(16)
    stored: list[bytes] = []
    for i, size in enumerate(sizes):
        item = bytes([i % 251 + 1]) * size
        pos = data.draw(st.integers(1, len(stored) + 1))
        assert bp.page_add_item(page, item, pos, overwrite=False, is_heap=False) == pos
        stored.insert(pos - 1, item)
    assert _items(page) == stored
    dele = sorted(data.draw(st.sets(st.integers(1, len(stored)))))
    bp.page_index_multi_delete(page, dele)
    survivors = [it for i, it in enumerate(stored, 1) if i not in dele]
    assert _items(page) == survivors
    assert bp.get_lower(page) == 24 + 4 * len(survivors)
    if len(dele) > 2:
        _check_packed(page)
    assert bp.get_upper(page) == bp.get_special(page) - sum(bp.maxalign(len(s)) for s in survivors)


@given(
    sizes=st.lists(st.integers(24, 300), min_size=1, max_size=25),
    fates=st.lists(st.sampled_from(["keep", "dead", "unused", "redirect"]), min_size=25, max_size=25),
)
def test_repair_fragmentation(sizes: list[int], fates: list[str]) -> None:
    page = bp.new_page(0)
    for i, size in enumerate(sizes):
        assert bp.page_add_item(page, bytes([i + 1]) * size, i + 1, overwrite=True, is_heap=True)
    expect = {}
    for off in range(1, len(sizes) + 1):
        fate = fates[off - 1]
        if fate == "dead":
            bp.set_itemid(page, off, 0, bp.LP_DEAD, 0)
        elif fate == "unused":
            bp.set_itemid(page, off, 0, bp.LP_UNUSED, 0)
        elif fate == "redirect":
            bp.set_itemid(page, off, 1, bp.LP_REDIRECT, 0)
        else:
            expect[off] = bytes([off]) * sizes[off - 1]
    last_used = max((o for o in range(1, len(sizes) + 1) if fates[o - 1] != "unused"), default=0)
    bp.page_repair_fragmentation(page)
    assert bp.max_offset(page) == last_used
    for off, item in expect.items():
        raw = bp.get_itemid(page, off)
        assert bytes(page[bp.lp_off(raw) : bp.lp_off(raw) + bp.lp_len(raw)]) == item
    _check_packed(page)
    has_free = any(fates[o - 1] == "unused" for o in range(1, last_used + 1))
    assert bool(bp.get_flags(page) & bp.PD_HAS_FREE_LINES) == has_free


def test_truncate_line_pointer_array_keeps_first() -> None:
    page = bp.new_page(0)
    for i in range(4):
        bp.page_add_item(page, b"t" * 24, i + 1, overwrite=True, is_heap=True)
    for off in (2, 3, 4):
        bp.set_itemid(page, off, 0, bp.LP_UNUSED, 0)
    bp.page_truncate_line_pointer_array(page)
    assert bp.max_offset(page) == 1
    bp.set_itemid(page, 1, 0, bp.LP_UNUSED, 0)
    bp.page_truncate_line_pointer_array(page)
    assert bp.max_offset(page) == 1  # the first line pointer always stays
    assert bp.get_flags(page) & bp.PD_HAS_FREE_LINES


def test_masks_hide_hints_and_free_space() -> None:
    page = bp.new_page(0)
    tup = bytearray(29)
    struct.pack_into("<IIIHHHHHB", tup, 0, 100, 0, 7, 0, 0, 1, 3, 0x0900, 24)
    bp.page_add_item(page, tup, 1, overwrite=True, is_heap=True)
    other = bytearray(page)
    # hint bits, cid, LSN, checksum, prune xid, free space garbage, padding bytes
    struct.pack_into("<H", other, bp.get_upper(other) + 20, 0x0900 | 0x0100)
    struct.pack_into("<I", other, bp.get_upper(other) + 8, 99)
    bp.page_set_lsn(other, 12345)
    other[40:60] = b"\x55" * 20
    other[bp.get_upper(other) + 29 : bp.get_upper(other) + 32] = b"\x01\x02\x03"
    bp.set_prune_xid(other, 42)
    assert masked(page, 0, heap_mask) == masked(other, 0, heap_mask)
    other[bp.get_upper(other) + 24] ^= 1  # tuple data is not masked
    assert masked(page, 0, heap_mask) != masked(other, 0, heap_mask)
    c = bytearray(page)
    mask_unused_space(c)
    assert c[28:8160] == bytes(8160 - 28)


def _lp_shift_loop(page: bytearray, nline: int, offset: int, delta: int, stored_only: bool) -> None:
    """The line-pointer shift one pointer at a time (what ``bp._lp_shift`` does in one pass)."""
    for off in range(1, nline + 1):
        raw = bp.get_itemid(page, off)
        if (raw & 0x7FFF) <= offset and (raw >> 17 or not stored_only):
            bp.U32.pack_into(page, bp.itemid_pos(off), raw + delta)


_LP = st.builds(lambda off, flags, length: off | (flags << 15) | (length << 17),
                st.integers(0, bp.BLCKSZ - 1), st.integers(0, 3), st.integers(0, 0x7FFF))


@given(st.lists(_LP, max_size=400), st.integers(0, bp.BLCKSZ - 1), st.integers(-bp.BLCKSZ, bp.BLCKSZ),
       st.booleans())
def test_lp_shift_equals_the_loop(lps: list[int], offset: int, delta: int, stored_only: bool) -> None:
    # every pointer at or below ``offset`` must stay inside 15 bits after the shift, as on a page
    lps = [raw if (raw & 0x7FFF) > offset or 0 <= (raw & 0x7FFF) + delta < 0x8000 else raw & ~0x7FFF | offset + 1
           for raw in lps]
    page = bytearray(bp.BLCKSZ)
    struct.pack_into(f"<{len(lps)}I", page, bp.SIZE_OF_PAGE_HEADER, *lps)
    expect = bytearray(page)
    _lp_shift_loop(expect, len(lps), offset, delta, stored_only)
    bp._lp_shift(page, len(lps), offset, delta, stored_only)
    assert page == expect


@given(st.lists(_LP, max_size=400))
def test_mask_lp_flags_equals_the_loop(lps: list[int]) -> None:
    page = bytearray(bp.BLCKSZ)
    struct.pack_into(f"<{len(lps)}I", page, bp.SIZE_OF_PAGE_HEADER, *lps)
    bp.set_lower(page, bp.SIZE_OF_PAGE_HEADER + 4 * len(lps))
    expect = bytearray(page)
    for off in range(1, len(lps) + 1):  # PostgreSQL's loop: a used pointer becomes LP_UNUSED
        raw = bp.get_itemid(expect, off)
        if (raw >> 15) & 3:
            bp.U32.pack_into(expect, bp.itemid_pos(off), raw & ~(3 << 15))
    mask_lp_flags(page)
    assert page == expect


def _compactify_per_item(page: bytearray, items: list[tuple[int, int, int]], special: int) -> None:
    """compactify_tuples one item at a time (what ``bp._compactify`` does run by run)."""
    src = bytes(page)
    upper = special
    for offnum, itemoff, alen in items:
        upper -= alen
        page[upper : upper + alen] = src[itemoff : itemoff + alen]
        raw = bp.get_itemid(page, offnum)
        bp.U32.pack_into(page, bp.itemid_pos(offnum), (raw & ~0x7FFF) | upper)
    bp.set_upper(page, upper)


@given(st.lists(st.integers(1, 12), min_size=1, max_size=60), st.data())
def test_compactify_equals_the_per_item_moves(sizes: list[int], data: st.DataObject) -> None:
    # a packed page, then some items deleted: the survivors' moves come in runs
    page = bp.new_page(16)
    for i, n in enumerate(sizes):
        assert bp.page_add_item(page, bytes([i + 1]) * (8 * n - i % 8), i + 1, overwrite=False, is_heap=False) == i + 1
    keep = sorted(data.draw(st.sets(st.integers(1, len(sizes)))))
    items = []
    for off in range(1, len(sizes) + 1):
        raw = bp.get_itemid(page, off)
        if off in keep:
            items.append((off, bp.lp_off(raw), bp.maxalign(bp.lp_len(raw))))
    # distinct bytes everywhere past the pointers, so a wrong move shows
    page[1024:] = bytes(x % 251 for x in range(bp.BLCKSZ - 1024))
    expect = bytearray(page)
    _compactify_per_item(expect, items, bp.get_special(page))
    bp._compactify(page, items, bp.get_special(page))
    assert page == expect
