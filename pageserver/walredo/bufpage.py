"""PostgreSQL's 8 KiB page primitives (``storage/page/bufpage.c``) on a ``bytearray``.

Redo must reproduce the exact byte layout PostgreSQL produces, so each routine here follows
the placement rules of its C counterpart: where an item goes, which bytes move and by how
much, which header fields change. Everything edits the page in place; offsets are 1-based
item numbers as in PostgreSQL. Corrupt page pointers raise ``PageError``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

# the public name stays bufpage.PageError; the class lives in errors (the kernels raise it too)
from pageserver.walredo.errors import PageError as PageError

BLCKSZ = 8192
SIZE_OF_PAGE_HEADER = 24
ITEM_ID_SIZE = 4
PG_PAGE_LAYOUT_VERSION = 4
PAGE_SIZE_VERSION = BLCKSZ | PG_PAGE_LAYOUT_VERSION

# pd_flags
PD_HAS_FREE_LINES = 0x0001
PD_PAGE_FULL = 0x0002
PD_ALL_VISIBLE = 0x0004

# lp_flags
LP_UNUSED = 0
LP_NORMAL = 1
LP_REDIRECT = 2
LP_DEAD = 3

# MaxHeapTuplesPerPage: (BLCKSZ - header) / (MAXALIGN(23) + sizeof(ItemIdData))
MAX_HEAP_TUPLES_PER_PAGE = (BLCKSZ - SIZE_OF_PAGE_HEADER) // (24 + ITEM_ID_SIZE)

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
I32 = struct.Struct("<i")
U16x2 = struct.Struct("<HH")
# pd_lower, pd_upper, pd_special
LOWER_UPPER_SPECIAL = struct.Struct("<HHH")
# pd_lsn is two u32 halves (xlogid, xrecoff), not one u64.
LSN_HALVES = struct.Struct("<II")
PAGE_HEADER = struct.Struct("<IIHHHHHHI")

OFF_LSN = 0
OFF_CHECKSUM = 8
OFF_FLAGS = 10
OFF_LOWER = 12
OFF_UPPER = 14
OFF_SPECIAL = 16
OFF_PAGESIZE_VERSION = 18
OFF_PRUNE_XID = 20

_pack_u16 = U16.pack_into
_unpack_u16 = U16.unpack_from
_pack_u32 = U32.pack_into
_unpack_u32 = U32.unpack_from


def maxalign(n: int) -> int:
    return (n + 7) & ~7


def shortalign(n: int) -> int:
    return (n + 1) & ~1


# --- header fields ---------------------------------------------------------------------


def page_get_lsn(page: bytes | bytearray | memoryview) -> int:
    hi, lo = LSN_HALVES.unpack_from(page, OFF_LSN)
    v: int = (hi << 32) | lo
    return v


def page_set_lsn(page: bytearray, lsn: int) -> None:
    LSN_HALVES.pack_into(page, OFF_LSN, lsn >> 32, lsn & 0xFFFF_FFFF)


def page_is_new(page: bytes | bytearray | memoryview) -> bool:
    """PageIsNew: an all-zero page has pd_upper == 0."""
    v: int = _unpack_u16(page, OFF_UPPER)[0]
    return v == 0


def get_lower(page: bytes | bytearray | memoryview) -> int:
    v: int = _unpack_u16(page, OFF_LOWER)[0]
    return v


def get_upper(page: bytes | bytearray | memoryview) -> int:
    v: int = _unpack_u16(page, OFF_UPPER)[0]
    return v


def get_special(page: bytes | bytearray | memoryview) -> int:
    v: int = _unpack_u16(page, OFF_SPECIAL)[0]
    return v


def get_flags(page: bytes | bytearray | memoryview) -> int:
    v: int = _unpack_u16(page, OFF_FLAGS)[0]
    return v


def set_flags(page: bytearray, flags: int) -> None:
    _pack_u16(page, OFF_FLAGS, flags)


def set_lower(page: bytearray, v: int) -> None:
    _pack_u16(page, OFF_LOWER, v)


def set_upper(page: bytearray, v: int) -> None:
    _pack_u16(page, OFF_UPPER, v)


def get_prune_xid(page: bytes | bytearray | memoryview) -> int:
    v: int = _unpack_u32(page, OFF_PRUNE_XID)[0]
    return v


def set_prune_xid(page: bytearray, xid: int) -> None:
    _pack_u32(page, OFF_PRUNE_XID, xid)


def max_offset(page: bytes | bytearray | memoryview) -> int:
    """PageGetMaxOffsetNumber: 0 on a page whose pd_lower is at or below the header."""
    lower = _unpack_u16(page, OFF_LOWER)[0]
    return 0 if lower <= SIZE_OF_PAGE_HEADER else (lower - SIZE_OF_PAGE_HEADER) // ITEM_ID_SIZE


def special_offset(page: bytes | bytearray | memoryview) -> int:
    v: int = _unpack_u16(page, OFF_SPECIAL)[0]
    return v


def page_set_all_visible(page: bytearray) -> None:
    _pack_u16(page, OFF_FLAGS, _unpack_u16(page, OFF_FLAGS)[0] | PD_ALL_VISIBLE)


def page_clear_all_visible(page: bytearray) -> None:
    _pack_u16(page, OFF_FLAGS, _unpack_u16(page, OFF_FLAGS)[0] & ~PD_ALL_VISIBLE)


def page_set_prunable(page: bytearray, xid: int) -> None:
    """PageSetPrunable: keep the oldest xid (in wraparound order) as pd_prune_xid."""
    cur = _unpack_u32(page, OFF_PRUNE_XID)[0]
    if cur == 0 or transaction_id_precedes(xid, cur):
        _pack_u32(page, OFF_PRUNE_XID, xid)


def transaction_id_precedes(id1: int, id2: int) -> bool:
    if id1 < 3 or id2 < 3:
        return id1 < id2
    diff = (id1 - id2) & 0xFFFF_FFFF
    return diff >= 0x8000_0000


def page_init(page: bytearray, special_size: int) -> None:
    """PageInit: zero the page, then lower/upper/special and the size+version word."""
    special = BLCKSZ - maxalign(special_size)
    page[:] = bytes(BLCKSZ)
    LOWER_UPPER_SPECIAL.pack_into(page, OFF_LOWER, SIZE_OF_PAGE_HEADER, special, special)
    _pack_u16(page, OFF_PAGESIZE_VERSION, PAGE_SIZE_VERSION)


def new_page(special_size: int) -> bytearray:
    page = bytearray(BLCKSZ)
    page_init(page, special_size)
    return page


# --- line pointers ----------------------------------------------------------------------


def itemid_pos(offnum: int) -> int:
    return SIZE_OF_PAGE_HEADER + (offnum - 1) * ITEM_ID_SIZE


def get_itemid(page: bytes | bytearray | memoryview, offnum: int) -> int:
    """The raw 32-bit line pointer: lp_off bits 0-14, lp_flags 15-16, lp_len 17-31."""
    v: int = _unpack_u32(page, SIZE_OF_PAGE_HEADER + (offnum - 1) * ITEM_ID_SIZE)[0]
    return v


def set_itemid(page: bytearray, offnum: int, off: int, flags: int, length: int) -> None:
    _pack_u32(
        page,
        SIZE_OF_PAGE_HEADER + (offnum - 1) * ITEM_ID_SIZE,
        (off & 0x7FFF) | (flags << 15) | (length << 17),
    )


def lp_off(itemid: int) -> int:
    return itemid & 0x7FFF


def lp_flags(itemid: int) -> int:
    return (itemid >> 15) & 3


def lp_len(itemid: int) -> int:
    return itemid >> 17


def itemid_is_used(itemid: int) -> bool:
    return ((itemid >> 15) & 3) != LP_UNUSED


def itemid_has_storage(itemid: int) -> bool:
    return (itemid >> 17) != 0


def item_offset(page: bytes | bytearray | memoryview, offnum: int) -> int:
    """PageGetItem's address for a line pointer, validated against the page bounds."""
    if offnum < 1 or offnum > max_offset(page):
        raise PageError(f"invalid offset number {offnum} (max {max_offset(page)})")
    v: int = _unpack_u32(page, SIZE_OF_PAGE_HEADER + (offnum - 1) * ITEM_ID_SIZE)[0] & 0x7FFF
    return v


def _check_pointers(page: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    lower, upper, special = LOWER_UPPER_SPECIAL.unpack_from(page, OFF_LOWER)
    if (
        lower < SIZE_OF_PAGE_HEADER
        or lower > upper
        or upper > special
        or special > BLCKSZ
        or special != maxalign(special)
    ):
        raise PageError(f"corrupted page pointers: lower = {lower}, upper = {upper}, special = {special}")
    return lower, upper, special


# --- adding items -----------------------------------------------------------------------


def page_add_item(
    page: bytearray,
    item: bytes | bytearray | memoryview,
    offnum: int,
    *,
    overwrite: bool,
    is_heap: bool,
) -> int:
    """PageAddItemExtended; returns the offset used, or 0 (InvalidOffsetNumber) when it fails.

    ``offnum`` 0 means "find a slot". Without ``overwrite`` an item inserted before the end
    shifts the later line pointers up (btree's shuffle mode).
    """
    lower, upper, special = LOWER_UPPER_SPECIAL.unpack_from(page, OFF_LOWER)
    if lower < SIZE_OF_PAGE_HEADER or lower > upper or upper > special or special > BLCKSZ:
        raise PageError(f"corrupted page pointers: lower = {lower}, upper = {upper}, special = {special}")
    limit = max_offset(page) + 1
    needshuffle = False
    if offnum != 0:
        if overwrite:
            if offnum < limit:
                itemid = get_itemid(page, offnum)
                if itemid_is_used(itemid) or itemid_has_storage(itemid):
                    return 0
        elif offnum < limit:
            needshuffle = True
    else:
        flags = get_flags(page)
        if flags & PD_HAS_FREE_LINES:
            offnum = 1
            while offnum < limit:
                itemid = get_itemid(page, offnum)
                if not itemid_is_used(itemid) and not itemid_has_storage(itemid):
                    break
                offnum += 1
            if offnum >= limit:
                set_flags(page, flags & ~PD_HAS_FREE_LINES)
        else:
            offnum = limit
    if offnum > limit:
        return 0
    if is_heap and offnum > MAX_HEAP_TUPLES_PER_PAGE:
        return 0
    new_lower = lower + ITEM_ID_SIZE if (offnum == limit or needshuffle) else lower
    size = len(item)
    new_upper = upper - maxalign(size)
    if new_lower > new_upper:
        return 0
    pos = itemid_pos(offnum)
    if needshuffle:
        end = itemid_pos(limit)
        page[pos + ITEM_ID_SIZE : end + ITEM_ID_SIZE] = page[pos:end]
    _pack_u32(page, pos, new_upper | (LP_NORMAL << 15) | (size << 17))
    page[new_upper : new_upper + size] = item
    LOWER_UPPER_SPECIAL.pack_into(page, OFF_LOWER, new_lower, new_upper, special)
    return offnum


# --- compaction -------------------------------------------------------------------------


def _lp_array(page: bytearray, nline: int) -> list[int]:
    return list(struct.unpack_from(f"<{nline}I", page, SIZE_OF_PAGE_HEADER))


def _compactify(page: bytearray, items: Sequence[tuple[int, int, int]], special: int) -> None:
    """compactify_tuples: pack (offnum, itemoff, alignedlen) downward from pd_special.

    Items are placed in the given order (line pointer order), each moved with its MAXALIGNed
    length, so padding bytes travel with the item. Line pointers keep flags and length.
    """
    nline = max_offset(page)
    lps = _lp_array(page, nline)
    src = bytes(page)
    upper = special
    # Items whose source bytes lie back to back in placement order (what a page keeps after a
    # delete: runs between the deleted tuples) move as one slice per run, not one per item.
    run_src = run_dst = -1  # the current run's lowest source and destination offsets
    run_len = 0
    for offnum, itemoff, alen in items:
        upper -= alen
        if run_len and itemoff + alen == run_src:
            run_src, run_dst = itemoff, upper
            run_len += alen
        else:
            if run_len and run_src != run_dst:
                page[run_dst : run_dst + run_len] = src[run_src : run_src + run_len]
            run_src, run_dst, run_len = itemoff, upper, alen
        lps[offnum - 1] = (lps[offnum - 1] & ~0x7FFF) | upper
    if run_len and run_src != run_dst:
        page[run_dst : run_dst + run_len] = src[run_src : run_src + run_len]
    struct.pack_into(f"<{nline}I", page, SIZE_OF_PAGE_HEADER, *lps)
    _pack_u16(page, OFF_UPPER, upper)


def page_repair_fragmentation(page: bytearray) -> None:
    """PageRepairFragmentation: compact items with storage; drop trailing unused pointers."""
    lower, upper, special = _check_pointers(page)
    nline = max_offset(page)
    lps = _lp_array(page, nline)
    items: list[tuple[int, int, int]] = []
    nunused = 0
    totallen = 0
    finalused = 0
    for i, itemid in enumerate(lps, 1):
        if (itemid >> 15) & 3:
            if itemid >> 17:
                off = itemid & 0x7FFF
                if off < upper or off >= special:
                    raise PageError(f"corrupted line pointer: {off}")
                alen = ((itemid >> 17) + 7) & ~7
                totallen += alen
                items.append((i, off, alen))
            finalused = i
        else:
            if itemid:
                lps[i - 1] = 0
                _pack_u32(page, SIZE_OF_PAGE_HEADER + (i - 1) * ITEM_ID_SIZE, 0)
            nunused += 1
    if not items:
        _pack_u16(page, OFF_UPPER, special)
    else:
        if totallen > special - lower:
            raise PageError(f"corrupted item lengths: total {totallen}, available space {special - lower}")
        _compactify(page, items, special)
    if finalused != nline:
        nunusedend = nline - finalused
        nunused -= nunusedend
        _pack_u16(page, OFF_LOWER, lower - ITEM_ID_SIZE * nunusedend)
    flags = get_flags(page)
    set_flags(page, flags | PD_HAS_FREE_LINES if nunused > 0 else flags & ~PD_HAS_FREE_LINES)


def page_truncate_line_pointer_array(page: bytearray) -> None:
    """PageTruncateLinePointerArray: drop trailing LP_UNUSED pointers (never the first)."""
    nline = max_offset(page)
    countdone = False
    sethint = False
    nunusedend = 0
    for i in range(nline, 0, -1):
        used = itemid_is_used(get_itemid(page, i))
        if not countdone and i > 1:
            if not used:
                nunusedend += 1
            else:
                countdone = True
        elif not used:
            sethint = True
            break
    if nunusedend > 0:
        _pack_u16(page, OFF_LOWER, get_lower(page) - ITEM_ID_SIZE * nunusedend)
    flags = get_flags(page)
    set_flags(page, flags | PD_HAS_FREE_LINES if sethint else flags & ~PD_HAS_FREE_LINES)


# --- index page deletes and overwrite ---------------------------------------------------


def _index_item(page: bytearray, offnum: int, nline: int, upper: int, special: int) -> tuple[int, int, int]:
    """(raw line pointer, offset, length) of item ``offnum``, checked as the PageIndex*
    routines check it before moving tuples."""
    if offnum <= 0 or offnum > nline:
        raise PageError(f"invalid index offnum: {offnum}")
    raw = get_itemid(page, offnum)
    size = raw >> 17
    offset = raw & 0x7FFF
    if offset < upper or offset + size > special or offset != maxalign(offset):
        raise PageError(f"corrupted line pointer: offset = {offset}, size = {size}")
    return raw, offset, size


# The line-pointer shifts below treat the whole array as one integer, each pointer a 32-bit
# lane (SWAR): a page holds hundreds of pointers and a Python loop over them was most of the
# cost of an index insert or delete. The compares never carry or borrow across lanes (lp_off is
# 15 bits, the intermediates 16), and adding a positive delta gives each lane exactly what
# ``raw + delta`` gives it (lp_off < 8192 where selected: no lane reaches 2**32). A negative
# delta (an overwrite with a larger tuple) takes the loop, which fails loudly on a corrupt
# pointer that would go below 0 instead of borrowing from its neighbour.
_LANE_ONES: dict[int, int] = {}


def _lane_ones(n: int) -> int:
    """An integer with 1 in the low bit of each of ``n`` 32-bit lanes."""
    ones = _LANE_ONES.get(n)
    if ones is None:
        ones = _LANE_ONES[n] = int.from_bytes(b"\x01\x00\x00\x00" * n, "little")
    return ones


def _lp_shift(page: bytearray, nline: int, offset: int, delta: int, stored_only: bool) -> None:
    """``lp_off += delta`` for each of the first ``nline`` line pointers with ``lp_off <=
    offset`` (only those with a length if ``stored_only``), in one pass over the array."""
    if nline <= 0 or delta == 0:
        return
    start = SIZE_OF_PAGE_HEADER
    end = start + ITEM_ID_SIZE * nline
    if end > len(page):
        raise PageError(f"{nline} line pointers do not fit the page")
    if delta < 0:
        fmt = f"<{nline}I"
        lps = struct.unpack_from(fmt, page, start)
        struct.pack_into(fmt, page, start, *[
            raw + delta if (raw & 0x7FFF) <= offset and (raw >> 17 or not stored_only) else raw for raw in lps])
        return
    x = int.from_bytes(page[start:end], "little")
    ones = _lane_ones(nline)
    low15 = ones * 0x7FFF
    # per lane: (0x8000 | offset) - lp_off has bit 15 set exactly where lp_off <= offset
    sel = ((ones * (0x8000 | offset) - (x & low15)) >> 15) & ones
    if stored_only:  # lp_len (bits 17..31) non-zero: adding 0x7FFF reaches bit 15
        sel &= (((x >> 17) & low15) + low15) >> 15
    page[start:end] = (x + sel * delta).to_bytes(end - start, "little")


def _shift_items_below(page: bytearray, nline: int, offset: int, delta: int) -> None:
    """Move the line pointers of stored items at or below ``offset`` by ``delta`` bytes
    (their tuples were just moved by as much)."""
    _lp_shift(page, nline, offset, delta, stored_only=True)


def page_index_tuple_delete(page: bytearray, offnum: int) -> None:
    """PageIndexTupleDelete: remove the pointer and close the gap by moving lower tuples up."""
    lower, upper, special = _check_pointers(page)
    nline = max_offset(page)
    _, offset, size = _index_item(page, offnum, nline, upper, special)
    size = maxalign(size)
    pos = itemid_pos(offnum)
    page[pos:lower - ITEM_ID_SIZE] = page[pos + ITEM_ID_SIZE : lower]
    if offset > upper:
        page[upper + size : offset + size] = page[upper:offset]
    upper += size
    lower -= ITEM_ID_SIZE
    LOWER_UPPER_SPECIAL.pack_into(page, OFF_LOWER, lower, upper, special)
    if lower > SIZE_OF_PAGE_HEADER:
        _lp_shift(page, nline - 1, offset, size, stored_only=False)


def page_index_multi_delete(page: bytearray, itemnos: Sequence[int]) -> None:
    """PageIndexMultiDelete: ``itemnos`` ascending; <= 2 items go through the retail delete."""
    nitems = len(itemnos)
    if nitems <= 2:
        for off in reversed(itemnos):
            page_index_tuple_delete(page, off)
        return
    lower, upper, special = _check_pointers(page)
    nline = max_offset(page)
    keep: list[int] = []
    items: list[tuple[int, int, int]] = []
    totallen = 0
    nextitm = 0
    # the pointer array unpacked once, kept ones packed back in one write: SP-GiST's
    # MOVE_LEAFS and PICKSPLIT delete from pages of hundreds of tuples
    for offnum, itemid in enumerate(struct.unpack_from(f"<{nline}I", page, SIZE_OF_PAGE_HEADER), 1):
        size = itemid >> 17
        offset = itemid & 0x7FFF
        if offset < upper or offset + size > special or offset & 7:
            raise PageError(f"corrupted line pointer: offset = {offset}, size = {size}")
        if nextitm < nitems and offnum == itemnos[nextitm]:
            nextitm += 1
        else:
            keep.append(itemid)
            alen = (size + 7) & ~7
            totallen += alen
            items.append((len(keep), offset, alen))
    if nextitm != nitems:
        raise PageError("incorrect index offsets supplied")
    if totallen > special - lower:
        raise PageError(f"corrupted item lengths: total {totallen}, available space {special - lower}")
    if keep:
        struct.pack_into(f"<{len(keep)}I", page, SIZE_OF_PAGE_HEADER, *keep)
    _pack_u16(page, OFF_LOWER, SIZE_OF_PAGE_HEADER + len(keep) * ITEM_ID_SIZE)
    if items:
        _compactify(page, items, special)
    else:
        _pack_u16(page, OFF_UPPER, special)


def page_index_tuple_delete_no_compact(page: bytearray, offnum: int) -> None:
    """PageIndexTupleDeleteNoCompact: mark the pointer unused (drop it if last), close the gap."""
    lower, upper, special = _check_pointers(page)
    nline = max_offset(page)
    _, offset, size = _index_item(page, offnum, nline, upper, special)
    size = maxalign(size)
    if offnum < nline:
        set_itemid(page, offnum, 0, 0, 0)
    else:
        lower -= ITEM_ID_SIZE
        nline -= 1
    if offset > upper:
        page[upper + size : offset + size] = page[upper:offset]
    upper += size
    LOWER_UPPER_SPECIAL.pack_into(page, OFF_LOWER, lower, upper, special)
    if lower > SIZE_OF_PAGE_HEADER:
        _shift_items_below(page, nline, offset, size)


def page_index_tuple_overwrite(page: bytearray, offnum: int, newtup: bytes | bytearray | memoryview) -> bool:
    """PageIndexTupleOverwrite: replace an item in place, shifting lower tuples by the size change."""
    lower, upper, special = _check_pointers(page)
    itemcount = max_offset(page)
    raw, offset, oldsize = _index_item(page, offnum, itemcount, upper, special)
    oldsize = maxalign(oldsize)
    newsize = len(newtup)
    alignednew = maxalign(newsize)
    if alignednew > oldsize + (upper - lower):
        return False
    size_diff = oldsize - alignednew
    if size_diff != 0:
        page[upper + size_diff : offset + size_diff] = page[upper:offset]
        _pack_u16(page, OFF_UPPER, upper + size_diff)
        _shift_items_below(page, itemcount, offset, size_diff)
    flags = (raw >> 15) & 3
    newoff = offset + size_diff
    _pack_u32(page, itemid_pos(offnum), newoff | (flags << 15) | (newsize << 17))
    page[newoff : newoff + newsize] = newtup
    return True


def page_append_items(page: bytearray, items: Sequence[bytes | bytearray | memoryview]) -> bool:
    """PageAddItem of each item at maxoff + 1 in turn (index pages: no shuffle, no free-line
    search), with the line pointers and tuples written directly; ``False`` (page unchanged)
    when they do not all fit. Same bytes as the one-at-a-time calls: only ``len(item)`` bytes
    are written, the MAXALIGN padding keeps what was there."""
    lower, upper, special = LOWER_UPPER_SPECIAL.unpack_from(page, OFF_LOWER)
    if lower < SIZE_OF_PAGE_HEADER or lower > upper or upper > special or special > BLCKSZ:
        raise PageError(f"corrupted page pointers: lower = {lower}, upper = {upper}, special = {special}")
    n = len(items)
    if n == 0:
        return True
    sizes = [len(it) for it in items]
    need = ITEM_ID_SIZE * n + sum((size + 7) & ~7 for size in sizes)
    if lower + need > upper:
        return False
    lps = []
    if all(size & 7 == 0 for size in sizes):
        # no padding to keep: the items go in as one write, the last one lowest
        page[upper - (need - ITEM_ID_SIZE * n) : upper] = b"".join(reversed(items))
        for size in sizes:
            upper -= size
            lps.append(upper | (LP_NORMAL << 15) | (size << 17))
    else:
        for it, size in zip(items, sizes, strict=True):
            upper -= (size + 7) & ~7
            page[upper : upper + size] = it
            lps.append(upper | (LP_NORMAL << 15) | (size << 17))
    struct.pack_into(f"<{n}I", page, lower, *lps)
    LOWER_UPPER_SPECIAL.pack_into(page, OFF_LOWER, lower + ITEM_ID_SIZE * n, upper, special)
    return True


def page_index_tuple_replace(page: bytearray, offnum: int, item: bytes | bytearray | memoryview) -> bool:
    """PageIndexTupleDelete(offnum) then PageAddItem(item, offnum) in shuffle mode, in one
    pass: the same bytes (the old tuple's space closed by moving the lower tuples up, the new
    one placed at the new pd_upper, the line pointer at ``offnum`` replaced, the padding left
    as it was). ``False`` (page unchanged) when the new item does not fit."""
    lower, upper, special = _check_pointers(page)
    nline = max_offset(page)
    _, offset, size = _index_item(page, offnum, nline, upper, special)
    size = maxalign(size)
    newlen = len(item)
    new_upper = upper + size - maxalign(newlen)
    if lower > new_upper:
        return False
    if offset > upper:
        page[upper + size : offset + size] = page[upper:offset]
    if nline > 1:
        _lp_shift(page, nline, offset, size, stored_only=False)
    _pack_u32(page, itemid_pos(offnum), new_upper | (LP_NORMAL << 15) | (newlen << 17))
    page[new_upper : new_upper + newlen] = item
    _pack_u16(page, OFF_UPPER, new_upper)
    return True


def page_index_tuple_replace_many(page: bytearray, pairs: Sequence[tuple[int, bytes | bytearray | memoryview]]) -> int:
    """``page_index_tuple_replace`` for each (offnum, item) in order (SP-GiST picksplits reuse
    dozens of placeholders on one page). Returns how many were done; the first that does not
    fit stops the run, with the page as the single calls would have left it."""
    lower, upper, special = _check_pointers(page)
    nline = max_offset(page)
    done = 0
    for offnum, item in pairs:
        # _index_item's checks inline: this loop runs once per placeholder (hundreds a page)
        if offnum <= 0 or offnum > nline:
            raise PageError(f"invalid index offnum: {offnum}")
        raw = get_itemid(page, offnum)
        length = raw >> 17
        offset = raw & 0x7FFF
        if offset < upper or offset + length > special or offset != maxalign(offset):
            raise PageError(f"corrupted line pointer: offset = {offset}, size = {length}")
        size = maxalign(length)
        newlen = len(item)
        new_upper = upper + size - maxalign(newlen)
        if lower > new_upper:
            break
        if offset > upper:
            page[upper + size : offset + size] = page[upper:offset]
        if nline > 1:
            _lp_shift(page, nline, offset, size, stored_only=False)
        _pack_u32(page, itemid_pos(offnum), new_upper | (LP_NORMAL << 15) | (newlen << 17))
        page[new_upper : new_upper + newlen] = item
        upper = new_upper
        _pack_u16(page, OFF_UPPER, upper)
        done += 1
    return done
