"""SP-GiST's bulk tuple moves on one page, in pure Python: the reference twin of
``_spgist_c.pyx`` (same names, signatures, results and error classes).

A PICKSPLIT or a MOVE_LEAFS carries a page's worth of leaf tuples (a few hundred) and deletes
as many from the page it splits; ``pageserver/walredo/spgist.py`` hands each such page part to
one call here instead of a Python step per tuple:

- ``skip_leaves(data, at, n)``: the end of ``n`` leaf tuples that lie back to back in ``data``
  from ``at`` (a leaf tuple's size is its first u32 >> 2; each must hold its 16-byte header and
  fit in ``data``).
- ``place_leaves(page, data, offsets_at, select_at, tuples_at, n, want)``: parses those ``n``
  tuples (all of them, before the page changes), then adds each selected one at its offset as
  ``addOrReplaceTuple`` (``spgxlog.c``) does: at ``maxoff + 1`` an append, at or below
  ``maxoff`` in place of a PLACEHOLDER (``nPlaceholder`` -= 1, PageIndexTupleDelete then
  PageAddItem at the same offset). The offsets are the u16 array at ``offsets_at``; tuple ``i``
  is selected when ``select_at`` is -1, or when ``data[select_at + i]`` is non-zero exactly if
  ``want`` is (a picksplit's ``leafPageSelect``). Returns the end of the last tuple.
- ``multi_delete(page, data, offsets_at, n, first_state, rest_state, blkno, offnum, xid)``:
  ``spgPageIndexMultiDelete``: PageIndexMultiDelete of the ``n`` u16 offsets at ``offsets_at``
  (sorted), then a 16-byte dead tuple added at each of them; the one named first in the
  (unsorted) array gets ``first_state``, the others ``rest_state``; a REDIRECT points at
  (``blkno``, ``offnum``) and keeps ``xid``; ``nRedirection`` / ``nPlaceholder`` count them.

Arguments outside their range (a page that is not 8 KiB, a negative count, arrays past the end
of ``data``, a state that is not 0-3) are ``ValueError``. Anything wrong in the bytes (a
truncated or oversized tuple, an offset past the page, a slot that is not a placeholder, a
tuple that does not fit, corrupt page pointers) is ``bufpage.PageError``; the page is then
garbage (the redo of that page fails) but nothing is written outside it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from pageserver.walredo import bufpage as bp
from pageserver.walredo.bufpage import PageError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "multi_delete", "place_leaves", "skip_leaves"]

IMPL: Final = "python"

SPGIST_REDIRECT = 1
SPGIST_PLACEHOLDER = 3
SGDTSIZE = 16
LEAF_HDR = 16  # SGLTHDRSZ
OPAQUE_SIZE = 8
_OPAQUE_POS = bp.BLCKSZ - OPAQUE_SIZE
_U16 = bp.U16
_U32 = bp.U32
# word0 (tupstate | size << 2), t_info, pointer (bi_hi, bi_lo, posid), xid
_DEAD = struct.Struct("<IHHHHI")


def _check_page(page: bytearray) -> None:
    if len(page) != bp.BLCKSZ:
        raise ValueError(f"the page is {len(page)} bytes, not {bp.BLCKSZ}")


def _check_array(data: bytes, at: int, nbytes: int, what: str) -> None:
    if at < 0 or nbytes > len(data) - at:
        raise ValueError(f"{what} at {at} ({nbytes} bytes) is not inside the {len(data)} bytes of data")


def _as_bytes(data: Buffer) -> bytes:
    """The record as ``bytes`` (the redo passes ``bytes``: no copy), so tuples slice out as bytes."""
    return data if type(data) is bytes else bytes(memoryview(data).cast("B"))


def _leaf_end(data: bytes, at: int, n: int) -> int:
    """Where ``n`` back-to-back leaf tuples from ``at`` end, each checked."""
    if n < 0:
        raise ValueError(f"negative tuple count {n}")
    _check_array(data, at, 0, "the first leaf tuple")
    total = len(data)
    unpack = _U32.unpack_from
    pos = at
    for i in range(n):
        if total - pos < LEAF_HDR:
            raise PageError(f"leaf tuple {i}: truncated header at {pos}")
        size = unpack(data, pos)[0] >> 2
        if size < LEAF_HDR:
            raise PageError(f"leaf tuple {i}: size {size} is below its header size")
        if size > total - pos:
            raise PageError(f"leaf tuple {i}: {size} bytes at {pos} do not fit in the data")
        pos += size
    return pos


def skip_leaves(data: Buffer, at: int, n: int) -> int:
    return _leaf_end(_as_bytes(data), at, n)


def _add_counter(page: bytearray, field: int, delta: int, what: str) -> None:
    """nRedirection (field 1) or nPlaceholder (field 2) += delta, on an SP-GiST page only."""
    special = bp.get_special(page)
    if special != _OPAQUE_POS:
        raise PageError(f"page special area at {special} is not an SP-GiST one")
    pos = special + 2 * field
    v = _U16.unpack_from(page, pos)[0] + delta
    if v < 0 or v > 0xFFFF:
        raise PageError(f"{what} count would become {v}")
    _U16.pack_into(page, pos, v)


def _item_pos(page: bytearray, off: int) -> int:
    """Where the tuple at ``off`` starts, its line pointer checked to lie inside the page."""
    maxoff = bp.max_offset(page)
    if off < 1 or off > maxoff:
        raise PageError(f"offset {off} is not on the page (max {maxoff})")
    if bp.itemid_pos(off) + bp.ITEM_ID_SIZE > bp.BLCKSZ:
        raise PageError(f"line pointer {off} is past the page")
    itemid = bp.get_itemid(page, off)
    pos = bp.lp_off(itemid)
    length = bp.lp_len(itemid)
    if length < 8 or pos < bp.SIZE_OF_PAGE_HEADER or pos + length > min(bp.get_special(page), bp.BLCKSZ):
        raise PageError(f"line pointer {off} ({pos}, {length}) is corrupt")
    return pos


def _add_at(page: bytearray, tup: bytes, off: int) -> None:
    """PageAddItem(tup, off) in shuffle mode (``off`` at most maxoff + 1)."""
    if off == bp.max_offset(page) + 1 and off > 0:
        if not bp.page_append_items(page, (tup,)):
            raise PageError(f"failed to add a tuple of size {len(tup)} at offset {off}")
        return
    if off == 0 or bp.page_add_item(page, tup, off, overwrite=False, is_heap=False) != off:
        raise PageError(f"failed to add a tuple of size {len(tup)} at offset {off}")


def _replace_placeholder(page: bytearray, off: int, tup: bytes) -> None:
    if page[_item_pos(page, off)] & 3 != SPGIST_PLACEHOLDER:
        raise PageError(f"tuple to be replaced at offset {off} is not a placeholder")
    _add_counter(page, 2, -1, "placeholder")
    if not bp.page_index_tuple_replace(page, off, tup):
        raise PageError(f"failed to add a tuple of size {len(tup)} at offset {off}")


def _add_or_replace_many(page: bytearray, pairs: Sequence[tuple[int, bytes]]) -> None:
    """addOrReplaceTuple of each (offset, tuple) in order. Runs that append at the end of the
    page (a split's new page) go in one write; runs that reuse placeholders in one pass over
    the line pointers (same bytes as one at a time: tests/pageserver/test_walredo_gist_append.py)."""
    i = 0
    n = len(pairs)
    while i < n:
        nxt = bp.max_offset(page) + 1
        j = i
        while j < n and pairs[j][0] == nxt + (j - i):
            j += 1
        if j > i:
            if not bp.page_append_items(page, [t for _, t in pairs[i:j]]):
                raise PageError(f"failed to add {j - i} tuples at offset {nxt}")
            i = j
            continue
        maxoff = nxt - 1
        while j < n and 1 <= pairs[j][0] <= maxoff:
            j += 1
        if j == i:
            _add_at(page, pairs[i][1], pairs[i][0])  # past maxoff + 1, or 0: reports it
            i += 1
            continue
        run = pairs[i:j]
        if len({off for off, _ in run}) != len(run):
            # the same slot twice: the second must see the first's tuple, so go one by one
            for off, tup in run:
                _replace_placeholder(page, off, tup)
            i = j
            continue
        for off, _ in run:
            if page[_item_pos(page, off)] & 3 != SPGIST_PLACEHOLDER:
                raise PageError(f"tuple to be replaced at offset {off} is not a placeholder")
        _add_counter(page, 2, -len(run), "placeholder")
        if bp.page_index_tuple_replace_many(page, run) != len(run):
            raise PageError("failed to add a tuple in place of a placeholder")
        i = j


def place_leaves(page: bytearray, data: Buffer, offsets_at: int, select_at: int, tuples_at: int, n: int, want: int) -> int:
    _check_page(page)
    raw = _as_bytes(data)
    if n < 0:
        raise ValueError(f"negative tuple count {n}")
    _check_array(raw, offsets_at, 2 * n, "the offsets")
    if select_at != -1:
        _check_array(raw, select_at, n, "the page selectors")
    end = _leaf_end(raw, tuples_at, n)  # every tuple checked before the page changes
    offsets = struct.unpack_from(f"<{n}H", raw, offsets_at)
    unpack = _U32.unpack_from
    pairs: list[tuple[int, bytes]] = []
    pos = tuples_at
    if select_at == -1:
        for off in offsets:
            nxt = pos + (unpack(raw, pos)[0] >> 2)
            pairs.append((off, raw[pos:nxt]))
            pos = nxt
    else:
        dest = bool(want)
        for i, off in enumerate(offsets):
            nxt = pos + (unpack(raw, pos)[0] >> 2)
            if bool(raw[select_at + i]) == dest:
                pairs.append((off, raw[pos:nxt]))
            pos = nxt
    _add_or_replace_many(page, pairs)
    return end


def _form_dead(state: int, blkno: int, offnum: int, xid: int) -> bytes:
    """spgFormDeadTuple: a REDIRECT points at (blkno, offnum) and keeps the xid."""
    word0 = state | (SGDTSIZE << 2)
    if state == SPGIST_REDIRECT:
        return _DEAD.pack(word0, 0, blkno >> 16, blkno & 0xFFFF, offnum, xid)
    return _DEAD.pack(word0, 0, 0xFFFF, 0xFFFF, 0, 0)


def multi_delete(
    page: bytearray,
    data: Buffer,
    offsets_at: int,
    n: int,
    first_state: int,
    rest_state: int,
    blkno: int,
    offnum: int,
    xid: int,
) -> None:
    _check_page(page)
    raw = _as_bytes(data)
    if n < 0:
        raise ValueError(f"negative offset count {n}")
    _check_array(raw, offsets_at, 2 * n, "the offsets")
    if not (0 <= first_state <= 3 and 0 <= rest_state <= 3):
        raise ValueError(f"tuple states {first_state}, {rest_state} are not 0-3")
    if not (0 <= blkno <= 0xFFFF_FFFF and 0 <= offnum <= 0xFFFF and 0 <= xid <= 0xFFFF_FFFF):
        raise ValueError(f"block {blkno}, offset {offnum} or xid {xid} is out of range")
    if n == 0:
        return
    offs = struct.unpack_from(f"<{n}H", raw, offsets_at)
    ordered = sorted(offs)
    bp.page_index_multi_delete(page, ordered)
    first = offs[0]
    dead = {s: _form_dead(s, blkno, offnum, xid) for s in {first_state, rest_state}}
    for itemno in ordered:
        state = first_state if itemno == first else rest_state
        _add_at(page, dead[state], itemno)
        if state == SPGIST_REDIRECT:
            _add_counter(page, 1, 1, "redirection")
        elif state == SPGIST_PLACEHOLDER:
            _add_counter(page, 2, 1, "placeholder")
