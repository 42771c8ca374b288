"""Btree (rmid 11) redo on one page: PostgreSQL's ``nbtxlog.c``, block by block.

A record touches several pages (a split: left, new right, right sibling, child); the
manager calls ``redo_btree`` once per requested page with that page's block reference, and
only the part of the routine for that block runs. Every part reads only its own page and the
record, so page-at-a-time replay is exact. Posting-list helpers follow ``nbtdedup.c``
(``_bt_swap_posting``, ``_bt_form_posting``, the dedup pending-list state) closely enough to
reproduce the same bytes.
"""

from __future__ import annotations

import struct

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_BTREE_DEDUP,
    XLOG_BTREE_DELETE,
    XLOG_BTREE_INSERT_LEAF,
    XLOG_BTREE_INSERT_META,
    XLOG_BTREE_INSERT_POST,
    XLOG_BTREE_INSERT_UPPER,
    XLOG_BTREE_MARK_PAGE_HALFDEAD,
    XLOG_BTREE_META_CLEANUP,
    XLOG_BTREE_NEWROOT,
    XLOG_BTREE_SPLIT_L,
    XLOG_BTREE_SPLIT_R,
    XLOG_BTREE_UNLINK_PAGE,
    XLOG_BTREE_UNLINK_PAGE_META,
    XLOG_BTREE_VACUUM,
)

BTP_LEAF = 1 << 0
BTP_ROOT = 1 << 1
BTP_DELETED = 1 << 2
BTP_META = 1 << 3
BTP_HALF_DEAD = 1 << 4
BTP_SPLIT_END = 1 << 5
BTP_HAS_GARBAGE = 1 << 6
BTP_INCOMPLETE_SPLIT = 1 << 7
BTP_HAS_FULLXID = 1 << 8

P_NONE = 0
P_HIKEY = 1
BTREE_MAGIC = 0x053162
SIZEOF_BT_OPAQUE = 16
INDEX_SIZE_MASK = 0x1FFF
INDEX_ALT_TID_MASK = 0x2000
BT_IS_POSTING = 0x2000
BT_OFFSET_MASK = 0x0FFF
SIZEOF_INDEX_TUPLE = 8
SIZEOF_ITEM_POINTER = 6

_U16 = bp.U16
_U32 = bp.U32
# btpo_prev, btpo_next, btpo_level, btpo_flags, btpo_cycleid
_OPAQUE = struct.Struct("<IIIHH")
# magic, version, root, level, fastroot, fastlevel, last_cleanup_num_delpages, (pad),
# last_cleanup_num_heap_tuples (float8), allequalimage
_META = struct.Struct("<IIIIIII4xd?7x")
_XL_METADATA = struct.Struct("<IIIIIIB")
_XL_SPLIT = struct.Struct("<IHHH")  # level, firstrightoff, newitemoff, postingoff
_XL_NEWROOT = struct.Struct("<II")  # rootblk, level
_XL_VACUUM = struct.Struct("<HH")  # ndeleted, nupdated
_XL_DELETE = struct.Struct("<IHH")  # latestRemovedXid, ndeleted, nupdated
_XL_HALFDEAD = struct.Struct("<HxxIIII")  # poffset, leafblk, leftblk, rightblk, topparent
_XL_UNLINK = struct.Struct("<III4xQIII")  # leftsib, rightsib, level, safexid, leafleftsib, leafrightsib, leaftopparent
_TID = struct.Struct("<HHH")


def _opaque_pos(page: bytearray) -> int:
    return bp.get_special(page)


def get_opaque(page: bytearray) -> tuple[int, int, int, int, int]:
    v: tuple[int, int, int, int, int] = _OPAQUE.unpack_from(page, _opaque_pos(page))
    return v


def set_opaque(page: bytearray, prev: int, nxt: int, level: int, flags: int, cycleid: int) -> None:
    _OPAQUE.pack_into(page, _opaque_pos(page), prev, nxt, level, flags, cycleid)


def _set_flags(page: bytearray, flags: int) -> None:
    _U16.pack_into(page, _opaque_pos(page) + 12, flags)


def _get_flags(page: bytearray) -> int:
    v: int = _U16.unpack_from(page, _opaque_pos(page) + 12)[0]
    return v


def _page_init(page: bytearray) -> None:
    bp.page_init(page, SIZEOF_BT_OPAQUE)


def _add(page: bytearray, item: bytes | bytearray | memoryview, offnum: int, rec: DecodedRecord, what: str) -> None:
    if bp.page_add_item(page, item, offnum, overwrite=False, is_heap=False) == 0:
        raise RedoError(f"btree: failed to add {what} at offset {offnum}", lsn=rec.end_lsn, rmgr="Btree")


def _tuple_size(buf: bytes | bytearray, pos: int = 0) -> int:
    v: int = _U16.unpack_from(buf, pos + 6)[0] & INDEX_SIZE_MASK
    return v


def _item(page: bytearray, offnum: int) -> bytes:
    itemid = bp.get_itemid(page, offnum)
    off = itemid & 0x7FFF
    return bytes(page[off : off + (itemid >> 17)])


# --- index tuple helpers (nbtree.h / nbtdedup.c) -------------------------------------------


def _is_posting(tup: bytes | bytearray) -> bool:
    t_info = _U16.unpack_from(tup, 6)[0]
    posid = _U16.unpack_from(tup, 4)[0]
    return bool(t_info & INDEX_ALT_TID_MASK) and bool(posid & BT_IS_POSTING)


def _posting_offset(tup: bytes | bytearray) -> int:
    hi, lo = struct.unpack_from("<HH", tup, 0)
    v: int = (hi << 16) | lo
    return v


def _nposting(tup: bytes | bytearray) -> int:
    v: int = _U16.unpack_from(tup, 4)[0] & BT_OFFSET_MASK
    return v


def _htids(tup: bytes | bytearray) -> list[bytes]:
    """The heap TIDs of a non-pivot tuple (one, or a posting list), 6 bytes each."""
    if _is_posting(tup):
        start = _posting_offset(tup)
        return [bytes(tup[start + 6 * i : start + 6 * i + 6]) for i in range(_nposting(tup))]
    return [bytes(tup[0:6])]


def form_posting(base: bytes | bytearray, htids: list[bytes]) -> bytes:
    """_bt_form_posting: the base tuple's key with ``htids`` as its TID(s)."""
    keysize = _posting_offset(base) if _is_posting(base) else _tuple_size(base)
    n = len(htids)
    newsize = bp.maxalign(keysize + n * SIZEOF_ITEM_POINTER) if n > 1 else keysize
    tup = bytearray(newsize)
    tup[:keysize] = base[:keysize]
    (t_info,) = _U16.unpack_from(tup, 6)
    t_info = (t_info & ~INDEX_SIZE_MASK) | newsize
    if n > 1:
        t_info |= INDEX_ALT_TID_MASK
        _U16.pack_into(tup, 6, t_info)
        _TID.pack_into(tup, 0, keysize >> 16, keysize & 0xFFFF, n | BT_IS_POSTING)
        tup[keysize : keysize + 6 * n] = b"".join(htids)
    else:
        t_info &= ~INDEX_ALT_TID_MASK
        _U16.pack_into(tup, 6, t_info)
        tup[0:6] = htids[0]
    return bytes(tup)


def swap_posting(newitem: bytearray, oposting: bytes, postingoff: int, rec: DecodedRecord) -> bytes:
    """_bt_swap_posting: returns the new posting tuple; ``newitem``'s TID becomes the old max."""
    n = _nposting(oposting)
    if not 0 < postingoff < n:
        raise RedoError(f"btree: posting list split offset {postingoff} outside (0, {n})", lsn=rec.end_lsn)
    start = _posting_offset(oposting)
    npost = bytearray(oposting)
    rp = start + postingoff * 6
    nmove = (n - postingoff - 1) * 6
    npost[rp + 6 : rp + 6 + nmove] = oposting[rp : rp + nmove]
    npost[rp : rp + 6] = newitem[0:6]
    maxtid = start + (n - 1) * 6
    newitem[0:6] = oposting[maxtid : maxtid + 6]
    return bytes(npost)


# --- pieces shared by several records ------------------------------------------------------


def _restore_page(page: bytearray, data: bytes, rec: DecodedRecord) -> None:
    """_bt_restore_page: tuples logged in reverse order; add them back last-first."""
    items: list[tuple[int, int]] = []
    pos = 0
    end = len(data)
    while pos < end:
        if pos + SIZEOF_INDEX_TUPLE > end:
            raise RedoError("btree: truncated tuple in page data", lsn=rec.end_lsn)
        size = bp.maxalign(_tuple_size(data, pos))
        if size == 0:
            raise RedoError("btree: zero-length tuple in page data", lsn=rec.end_lsn)
        items.append((pos, size))
        pos += size
    n = len(items)
    for i in range(n - 1, -1, -1):
        p, size = items[i]
        _add(page, data[p : p + size], n - i, rec, "restored tuple")


def _restore_meta(page: bytearray, data: bytes, rec: DecodedRecord) -> None:
    if len(data) < _XL_METADATA.size:
        raise RedoError("btree: metadata block data too short", lsn=rec.end_lsn)
    version, root, level, fastroot, fastlevel, delpages, allequal = _XL_METADATA.unpack_from(data)
    _page_init(page)
    _META.pack_into(page, 24, BTREE_MAGIC, version, root, level, fastroot, fastlevel, delpages, -1.0, bool(allequal))
    set_opaque(page, 0, 0, 0, BTP_META, 0)
    bp.set_lower(page, 24 + _META.size)
    bp.page_set_lsn(page, rec.end_lsn)


def _clear_incomplete_split(page: bytearray, rec: DecodedRecord) -> None:
    _set_flags(page, _get_flags(page) & ~BTP_INCOMPLETE_SPLIT)
    bp.page_set_lsn(page, rec.end_lsn)


def _apply_updates(page: bytearray, data: bytes, pos: int, offsets: tuple[int, ...], rec: DecodedRecord) -> None:
    """btree_xlog_updates: rewrite posting tuples without some of their TIDs."""
    for off in offsets:
        (ndel,) = _U16.unpack_from(data, pos)
        dels = set(struct.unpack_from(f"<{ndel}H", data, pos + 2))
        pos += 2 + 2 * ndel
        orig = _item(page, off)
        keep = [t for i, t in enumerate(_htids(orig)) if i not in dels]
        if not keep:
            raise RedoError("btree: update removes every TID of a posting tuple", lsn=rec.end_lsn)
        newtup = form_posting(orig, keep)
        if not bp.page_index_tuple_overwrite(page, off, newtup):
            raise RedoError("btree: failed to overwrite posting tuple", lsn=rec.end_lsn)


def _delete_items(page: bytearray, data: bytes, ndeleted: int, nupdated: int, rec: DecodedRecord) -> None:
    deleted = struct.unpack_from(f"<{ndeleted}H", data, 0)
    if nupdated:
        updated = struct.unpack_from(f"<{nupdated}H", data, 2 * ndeleted)
        _apply_updates(page, data, 2 * (ndeleted + nupdated), updated, rec)
    if ndeleted:
        bp.page_index_multi_delete(page, deleted)
    _set_flags(page, _get_flags(page) & ~BTP_HAS_GARBAGE)
    bp.page_set_lsn(page, rec.end_lsn)


def _halfdead_leaf(page: bytearray, prev: int, nxt: int, topparent: int, rec: DecodedRecord) -> None:
    _page_init(page)
    set_opaque(page, prev, nxt, 0, BTP_HALF_DEAD | BTP_LEAF, 0)
    # dummy high key: t_tid block = top parent, offset = 0 key attributes, ALT_TID set
    trunc = bytearray(SIZEOF_INDEX_TUPLE)
    _TID.pack_into(trunc, 0, topparent >> 16, topparent & 0xFFFF, 0)
    _U16.pack_into(trunc, 6, SIZEOF_INDEX_TUPLE | INDEX_ALT_TID_MASK)
    _add(page, trunc, P_HIKEY, rec, "dummy high key")
    bp.page_set_lsn(page, rec.end_lsn)


# --- records ----------------------------------------------------------------------------


def _insert(page: bytearray, rec: DecodedRecord, blk: BlockRef, posting: bool) -> None:
    (offnum,) = _U16.unpack_from(rec.main_data, 0)
    data = blk.data
    if not posting:
        _add(page, data, offnum, rec, "new item")
    else:
        (postingoff,) = _U16.unpack_from(data, 0)
        newitem = bytearray(data[2:])
        oitemid = bp.get_itemid(page, offnum - 1)
        ooff = oitemid & 0x7FFF
        oposting = bytes(page[ooff : ooff + (oitemid >> 17)])
        nposting = swap_posting(newitem, oposting, postingoff, rec)
        size = bp.maxalign(_tuple_size(nposting))
        page[ooff : ooff + size] = nposting[:size]
        _add(page, newitem, offnum, rec, "posting split new item")
    bp.page_set_lsn(page, rec.end_lsn)


def _split_left(page: bytearray, rec: DecodedRecord, blk: BlockRef, newitemonleft: bool) -> None:
    level, firstrightoff, newitemoff, postingoff = _XL_SPLIT.unpack_from(rec.main_data)
    right = rec.block(1)
    if right is None:
        raise RedoError("btree split without the right page", lsn=rec.end_lsn)
    data = blk.data
    pos = 0
    newitem: bytearray | None = None
    nposting: bytes | None = None
    replacepostingoff = 0
    if newitemonleft or postingoff:
        size = bp.maxalign(_tuple_size(data, 0))
        newitem = bytearray(data[:size])
        pos = size
        if postingoff:
            replacepostingoff = newitemoff - 1
            nposting = swap_posting(newitem, _item(page, replacepostingoff), postingoff, rec)
    hsize = bp.maxalign(_tuple_size(data, pos))
    hikey = data[pos : pos + hsize]
    prev, nxt, olevel, _flags, _cyc = get_opaque(page)
    left = bytearray(bp.BLCKSZ)
    _page_init(left)
    left[bp.BLCKSZ - SIZEOF_BT_OPAQUE :] = page[bp.BLCKSZ - SIZEOF_BT_OPAQUE :]
    _add(left, hikey, P_HIKEY, rec, "left high key")
    leftoff = 2
    first = P_HIKEY if nxt == P_NONE else P_HIKEY + 1
    off = first
    while off < firstrightoff:
        if off == replacepostingoff:
            assert nposting is not None
            _add(left, nposting[: bp.maxalign(_tuple_size(nposting))], leftoff, rec, "posting list")
            leftoff += 1
            off += 1
            continue
        if newitemonleft and off == newitemoff:
            assert newitem is not None
            _add(left, newitem, leftoff, rec, "new item")
            leftoff += 1
        _add(left, _item(page, off), leftoff, rec, "old item")
        leftoff += 1
        off += 1
    if newitemonleft and off == newitemoff:
        assert newitem is not None
        _add(left, newitem, leftoff, rec, "new item")
    page[:] = left
    flags = BTP_INCOMPLETE_SPLIT | (BTP_LEAF if level == 0 else 0)
    set_opaque(page, prev, right.blkno, olevel, flags, 0)
    bp.page_set_lsn(page, rec.end_lsn)


def _split(page: bytearray, rec: DecodedRecord, blk: BlockRef, newitemonleft: bool) -> None:
    level = _U32.unpack_from(rec.main_data, 0)[0]
    bid = blk.block_id
    if bid == 0:
        _split_left(page, rec, blk, newitemonleft)
    elif bid == 1:
        left = rec.block(0)
        assert left is not None
        sib = rec.block(2)
        _page_init(page)
        set_opaque(page, left.blkno, sib.blkno if sib is not None else P_NONE, level, BTP_LEAF if level == 0 else 0, 0)
        _restore_page(page, blk.data, rec)
        bp.page_set_lsn(page, rec.end_lsn)
    elif bid == 2:
        right = rec.block(1)
        assert right is not None
        _U32.pack_into(page, _opaque_pos(page), right.blkno)
        bp.page_set_lsn(page, rec.end_lsn)
    elif bid == 3:
        _clear_incomplete_split(page, rec)
    else:
        raise RedoError(f"btree split has no block {bid}", lsn=rec.end_lsn)


def _dedup(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    (nintervals,) = _U16.unpack_from(rec.main_data, 0)
    intervals = [struct.unpack_from("<HH", blk.data, 4 * i) for i in range(nintervals)]
    _prev, nxt, _level, flags, _cycleid = get_opaque(page)
    minoff = P_HIKEY if nxt == P_NONE else P_HIKEY + 1
    maxoff = bp.max_offset(page)
    newpage = bytearray(bp.BLCKSZ)
    _page_init(newpage)
    newpage[bp.BLCKSZ - SIZEOF_BT_OPAQUE :] = page[bp.BLCKSZ - SIZEOF_BT_OPAQUE :]
    if nxt != P_NONE:
        _add(newpage, _item(page, P_HIKEY), P_HIKEY, rec, "high key")
    # pending posting list: base tuple, its offset, collected TIDs, item count
    done_intervals = 0
    base = b""
    baseoff = 0
    htids: list[bytes] = []
    nitems = 0

    def finish() -> None:
        nonlocal done_intervals
        tupoff = bp.max_offset(newpage) + 1
        if nitems == 1:
            _add(newpage, base, tupoff, rec, "dedup base tuple")
        else:
            _add(newpage, form_posting(base, htids), tupoff, rec, "dedup posting tuple")
            done_intervals += 1

    for off in range(minoff, maxoff + 1):
        tup = _item(page, off)
        if off == minoff:
            base, baseoff, htids, nitems = tup, off, _htids(tup), 1
        elif done_intervals < nintervals and baseoff == intervals[done_intervals][0] and nitems < intervals[done_intervals][1]:
            htids += _htids(tup)
            nitems += 1
        else:
            finish()
            base, baseoff, htids, nitems = tup, off, _htids(tup), 1
    finish()
    if done_intervals != nintervals:
        raise RedoError(f"btree dedup built {done_intervals} posting lists, record says {nintervals}", lsn=rec.end_lsn)
    if flags & BTP_HAS_GARBAGE:
        _set_flags(newpage, flags & ~BTP_HAS_GARBAGE)
    page[:] = newpage
    bp.page_set_lsn(page, rec.end_lsn)


def _mark_halfdead(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    poffset, _leafblk, leftblk, rightblk, topparent = _XL_HALFDEAD.unpack_from(rec.main_data)
    if blk.block_id == 1:
        nxt = poffset + 1
        itemid = bp.get_itemid(page, nxt)
        hi, lo = struct.unpack_from("<HH", page, itemid & 0x7FFF)
        pos = bp.get_itemid(page, poffset) & 0x7FFF
        struct.pack_into("<HH", page, pos, hi, lo)
        bp.page_index_tuple_delete(page, nxt)
        bp.page_set_lsn(page, rec.end_lsn)
    elif blk.block_id == 0:
        _halfdead_leaf(page, leftblk, rightblk, topparent, rec)
    else:
        raise RedoError(f"btree mark_page_halfdead has no block {blk.block_id}", lsn=rec.end_lsn)


def _unlink(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    leftsib, rightsib, level, safexid, leafleft, leafright, leaftop = _XL_UNLINK.unpack_from(rec.main_data)
    bid = blk.block_id
    if bid == 1:
        _U32.pack_into(page, _opaque_pos(page) + 4, rightsib)
        bp.page_set_lsn(page, rec.end_lsn)
    elif bid == 0:
        _page_init(page)
        flags = BTP_DELETED | BTP_HAS_FULLXID | (BTP_LEAF if level == 0 else 0)
        set_opaque(page, leftsib, rightsib, level, flags, 0)
        bp.set_lower(page, 24 + 8)
        bp.set_upper(page, bp.get_special(page))
        struct.pack_into("<Q", page, 24, safexid)
        bp.page_set_lsn(page, rec.end_lsn)
    elif bid == 2:
        _U32.pack_into(page, _opaque_pos(page), leftsib)
        bp.page_set_lsn(page, rec.end_lsn)
    elif bid == 3:
        _halfdead_leaf(page, leafleft, leafright, leaftop, rec)
    elif bid == 4:
        _restore_meta(page, blk.data, rec)
    else:
        raise RedoError(f"btree unlink_page has no block {bid}", lsn=rec.end_lsn)


def _newroot(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    _rootblk, level = _XL_NEWROOT.unpack_from(rec.main_data)
    bid = blk.block_id
    if bid == 0:
        _page_init(page)
        set_opaque(page, P_NONE, P_NONE, level, BTP_ROOT | (BTP_LEAF if level == 0 else 0), 0)
        if level > 0:
            _restore_page(page, blk.data, rec)
        bp.page_set_lsn(page, rec.end_lsn)
    elif bid == 1:
        _clear_incomplete_split(page, rec)
    elif bid == 2:
        _restore_meta(page, blk.data, rec)
    else:
        raise RedoError(f"btree newroot has no block {bid}", lsn=rec.end_lsn)


def redo_btree(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    info = rec.xl_info & 0xF0
    bid = blk.block_id
    if info in (XLOG_BTREE_INSERT_LEAF, XLOG_BTREE_INSERT_UPPER, XLOG_BTREE_INSERT_META, XLOG_BTREE_INSERT_POST):
        if bid == 0:
            _insert(page, rec, blk, posting=info == XLOG_BTREE_INSERT_POST)
        elif bid == 1 and info != XLOG_BTREE_INSERT_LEAF:
            _clear_incomplete_split(page, rec)
        elif bid == 2 and info == XLOG_BTREE_INSERT_META:
            _restore_meta(page, blk.data, rec)
        else:
            raise RedoError(f"btree insert has no block {bid}", lsn=rec.end_lsn)
    elif info in (XLOG_BTREE_SPLIT_L, XLOG_BTREE_SPLIT_R):
        _split(page, rec, blk, newitemonleft=info == XLOG_BTREE_SPLIT_L)
    elif info == XLOG_BTREE_VACUUM:
        ndeleted, nupdated = _XL_VACUUM.unpack_from(rec.main_data)
        _delete_items(page, blk.data, ndeleted, nupdated, rec)
    elif info == XLOG_BTREE_DELETE:
        _xid, ndeleted, nupdated = _XL_DELETE.unpack_from(rec.main_data)
        _delete_items(page, blk.data, ndeleted, nupdated, rec)
    elif info == XLOG_BTREE_DEDUP:
        _dedup(page, rec, blk)
    elif info == XLOG_BTREE_MARK_PAGE_HALFDEAD:
        _mark_halfdead(page, rec, blk)
    elif info in (XLOG_BTREE_UNLINK_PAGE, XLOG_BTREE_UNLINK_PAGE_META):
        _unlink(page, rec, blk)
    elif info == XLOG_BTREE_NEWROOT:
        _newroot(page, rec, blk)
    elif info == XLOG_BTREE_META_CLEANUP:
        _restore_meta(page, blk.data, rec)
    else:  # REUSE_PAGE references no block
        raise RedoError(f"btree record {info:#x} does not change pages", lsn=rec.end_lsn, rmgr="Btree")
