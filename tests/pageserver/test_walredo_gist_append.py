"""``bufpage.page_append_items`` (the bulk append GiST splits and SP-GiST picksplits use)
writes the same bytes as PageAddItem one item at a time at maxoff + 1."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pageserver.walredo import bufpage as bp

_items = st.lists(st.binary(min_size=8, max_size=600), max_size=40)
# MAXALIGNed items only (SP-GiST point leaves, most index tuples): the one-write path
_aligned = st.lists(st.integers(1, 75).flatmap(lambda n: st.binary(min_size=8 * n, max_size=8 * n)), max_size=40)


@given(prefill=_items, items=_items | _aligned, stale=st.integers(0, 255))
def test_bulk_append_equals_one_at_a_time(prefill: list[bytes], items: list[bytes], stale: int) -> None:
    page = bp.new_page(16)
    page[bp.SIZE_OF_PAGE_HEADER : bp.BLCKSZ - 16] = bytes([stale]) * (bp.BLCKSZ - 16 - bp.SIZE_OF_PAGE_HEADER)
    for it in prefill:  # a page already holding items (and stale bytes in its hole)
        if bp.page_add_item(page, it, bp.max_offset(page) + 1, overwrite=False, is_heap=False) == 0:
            break
    one = bytearray(page)
    fits = True
    for it in items:
        if bp.page_add_item(one, it, bp.max_offset(one) + 1, overwrite=False, is_heap=False) == 0:
            fits = False
            break
    bulk = bytearray(page)
    assert bp.page_append_items(bulk, items) is fits
    assert bulk == (one if fits else page)


@given(items=st.lists(st.binary(min_size=8, max_size=300), min_size=1, max_size=30), data=st.data(), stale=st.integers(0, 255))
def test_replace_equals_delete_then_add(items: list[bytes], data: st.DataObject, stale: int) -> None:
    """``page_index_tuple_replace`` (SP-GiST's placeholder replacement) writes the same bytes
    as PageIndexTupleDelete followed by PageAddItem at that offset."""
    page = bp.new_page(8)
    page[bp.SIZE_OF_PAGE_HEADER : bp.BLCKSZ - 8] = bytes([stale]) * (bp.BLCKSZ - 8 - bp.SIZE_OF_PAGE_HEADER)
    for it in items:
        if bp.page_add_item(page, it, 0, overwrite=False, is_heap=False) == 0:
            break
    n = bp.max_offset(page)
    if n == 0:
        return
    off = data.draw(st.integers(1, n))
    new = data.draw(st.binary(min_size=8, max_size=900))
    one = bytearray(page)
    bp.page_index_tuple_delete(one, off)
    fits = bp.page_add_item(one, new, off, overwrite=False, is_heap=False) == off
    fused = bytearray(page)
    assert bp.page_index_tuple_replace(fused, off, new) is fits
    if fits:
        assert fused == one
    else:
        assert fused == page


@given(items=st.lists(st.binary(min_size=8, max_size=200), min_size=1, max_size=40), data=st.data(), stale=st.integers(0, 255))
def test_replace_many_equals_one_at_a_time(items: list[bytes], data: st.DataObject, stale: int) -> None:
    page = bp.new_page(8)
    page[bp.SIZE_OF_PAGE_HEADER : bp.BLCKSZ - 8] = bytes([stale]) * (bp.BLCKSZ - 8 - bp.SIZE_OF_PAGE_HEADER)
    for it in items:
        if bp.page_add_item(page, it, 0, overwrite=False, is_heap=False) == 0:
            break
    n = bp.max_offset(page)
    pairs = data.draw(st.lists(st.tuples(st.integers(1, n), st.binary(min_size=8, max_size=400)), max_size=20))
    one = bytearray(page)
    done_one = 0
    for off, new in pairs:
        if not bp.page_index_tuple_replace(one, off, new):
            break
        done_one += 1
    many = bytearray(page)
    assert bp.page_index_tuple_replace_many(many, pairs) == done_one
    assert many == one
