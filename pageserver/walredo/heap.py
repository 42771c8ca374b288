"""Redo of the Heap (rmid 10) and Heap2 (rmid 9) resource managers on one page.

Each routine is PostgreSQL's ``heap_xlog_*`` restricted to the block of the page asked for:
the manager has already decided that the block needs redo (no applied image, page LSN older
than the record) and hands over the page bytes to edit in place. Visibility-map bits that
heap records clear without referencing the VM page are handled in ``visibilitymap``.
"""

from __future__ import annotations

import struct

from pageserver.walredo import _heap_select as placement
from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import PageError, RedoError
from pageserver.walredo.visibilitymap import VM_ALL_FROZEN, VM_VALID_BITS, vm_set_in_page
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_HEAP2_FREEZE_PAGE,
    XLOG_HEAP2_LOCK_UPDATED,
    XLOG_HEAP2_MULTI_INSERT,
    XLOG_HEAP2_PRUNE,
    XLOG_HEAP2_VACUUM,
    XLOG_HEAP2_VISIBLE,
    XLOG_HEAP_CONFIRM,
    XLOG_HEAP_DELETE,
    XLOG_HEAP_HOT_UPDATE,
    XLOG_HEAP_INIT_PAGE,
    XLOG_HEAP_INPLACE,
    XLOG_HEAP_INSERT,
    XLOG_HEAP_LOCK,
    XLOG_HEAP_OPMASK,
    XLOG_HEAP_UPDATE,
    RmgrId,
    record_type_name,
)

# xl_heap_insert / multi_insert flags
XLH_INSERT_ALL_VISIBLE_CLEARED = 0x01
XLH_INSERT_ALL_FROZEN_SET = 0x20
# xl_heap_update flags
XLH_UPDATE_OLD_ALL_VISIBLE_CLEARED = 0x01
XLH_UPDATE_NEW_ALL_VISIBLE_CLEARED = 0x02
XLH_UPDATE_PREFIX_FROM_OLD = 0x20
XLH_UPDATE_SUFFIX_FROM_OLD = 0x40
# xl_heap_delete flags
XLH_DELETE_ALL_VISIBLE_CLEARED = 0x01
XLH_DELETE_IS_SUPER = 0x08
XLH_DELETE_IS_PARTITION_MOVE = 0x10
# xl_heap_lock flags
XLH_LOCK_ALL_FROZEN_CLEARED = 0x01
# infobits
XLHL_XMAX_IS_MULTI = 0x01
XLHL_XMAX_LOCK_ONLY = 0x02
XLHL_XMAX_EXCL_LOCK = 0x04
XLHL_XMAX_KEYSHR_LOCK = 0x08
XLHL_KEYS_UPDATED = 0x10
# freeze flags
XLH_FREEZE_XVAC = 0x02
XLH_INVALID_XVAC = 0x04

# t_infomask
HEAP_XMAX_KEYSHR_LOCK = 0x0010
HEAP_COMBOCID = 0x0020
HEAP_XMAX_EXCL_LOCK = 0x0040
HEAP_XMAX_LOCK_ONLY = 0x0080
HEAP_LOCK_MASK = HEAP_XMAX_EXCL_LOCK | HEAP_XMAX_KEYSHR_LOCK
HEAP_XMIN_COMMITTED = 0x0100
HEAP_XMIN_INVALID = 0x0200
HEAP_XMIN_FROZEN = HEAP_XMIN_COMMITTED | HEAP_XMIN_INVALID
HEAP_XMAX_COMMITTED = 0x0400
HEAP_XMAX_INVALID = 0x0800
HEAP_XMAX_IS_MULTI = 0x1000
HEAP_MOVED = 0xC000
HEAP_XACT_MASK = 0xFFF0
HEAP_XMAX_BITS = (
    HEAP_XMAX_COMMITTED | HEAP_XMAX_INVALID | HEAP_XMAX_IS_MULTI | HEAP_LOCK_MASK | HEAP_XMAX_LOCK_ONLY
)
# t_infomask2
HEAP_KEYS_UPDATED = 0x2000
HEAP_HOT_UPDATED = 0x4000

SPEC_TOKEN_OFFSET = 0xFFFE
MOVED_PARTITIONS_OFFSET = 0xFFFD

# HeapTupleHeaderData field offsets
T_XMIN = 0
T_XMAX = 4
T_CID = 8
T_CTID = 12
T_INFOMASK2 = 18
T_INFOMASK = 20
T_HOFF = 22
SIZEOF_HEAP_TUPLE_HEADER = 23

_U16 = bp.U16
_U32 = bp.U32
_CTID = struct.Struct("<HHH")
_INFOMASKS = struct.Struct("<HH")  # infomask2, infomask
_XL_HEAP_HEADER = struct.Struct("<HHB")  # t_infomask2, t_infomask, t_hoff
_XL_HEAP_INSERT = struct.Struct("<HB")  # offnum, flags
_XL_HEAP_DELETE = struct.Struct("<IHBB")  # xmax, offnum, infobits_set, flags
_XL_HEAP_UPDATE = struct.Struct("<IHBBIH")  # old_xmax, old_offnum, old_infobits, flags, new_xmax, new_offnum
_XL_HEAP_LOCK = struct.Struct("<IHBB")  # locking_xid/xmax, offnum, infobits_set, flags
_XL_HEAP_PRUNE = struct.Struct("<IHH")  # latestRemovedXid, nredirected, ndead
_XL_HEAP_FREEZE_PAGE = struct.Struct("<IH")  # cutoff_xid, ntuples
_XL_HEAP_FREEZE_TUPLE = struct.Struct("<IHHHBx")  # xmax, offset, infomask2, infomask, frzflags
_XL_HEAP_VISIBLE = struct.Struct("<IB")  # cutoff_xid, flags


def _need(buf: bytes, st: struct.Struct, what: str, rec: DecodedRecord) -> tuple[int, ...]:
    if len(buf) < st.size:
        raise RedoError(f"{what}: main data has {len(buf)} bytes, needs {st.size}", lsn=rec.end_lsn)
    return st.unpack_from(buf)


def _normal_item(page: bytearray, offnum: int, rec: DecodedRecord, what: str) -> tuple[int, int]:
    """(offset, length) of an LP_NORMAL item; PANIC-worthy otherwise, an error here."""
    if offnum < 1 or offnum > bp.max_offset(page):
        raise RedoError(f"{what}: invalid lp {offnum} (max {bp.max_offset(page)})", lsn=rec.end_lsn)
    itemid = bp.get_itemid(page, offnum)
    if (itemid >> 15) & 3 != bp.LP_NORMAL:
        raise RedoError(f"{what}: lp {offnum} is not normal", lsn=rec.end_lsn)
    return itemid & 0x7FFF, itemid >> 17


def _put_tuple(
    page: bytearray,
    offnum: int,
    xmin: int,
    xmax: int,
    blkno: int,
    infomask2: int,
    infomask: int,
    hoff: int,
    body: bytes | bytearray | memoryview,
    rec: DecodedRecord,
) -> None:
    """Build the tuple and add it at ``offnum`` (PageAddItem, overwrite + heap mode): the
    placement kernel writes header and body straight into the page."""
    try:
        placement.put_tuple(page, offnum, xmin, xmax, blkno, infomask2, infomask, hoff, body)
    except PageError as exc:
        raise RedoError(str(exc), lsn=rec.end_lsn) from None


def _fix_infomask_from_infobits(infobits: int, infomask: int, infomask2: int) -> tuple[int, int]:
    infomask &= ~(HEAP_XMAX_IS_MULTI | HEAP_XMAX_LOCK_ONLY | HEAP_XMAX_KEYSHR_LOCK | HEAP_XMAX_EXCL_LOCK)
    infomask2 &= ~HEAP_KEYS_UPDATED
    if infobits & XLHL_XMAX_IS_MULTI:
        infomask |= HEAP_XMAX_IS_MULTI
    if infobits & XLHL_XMAX_LOCK_ONLY:
        infomask |= HEAP_XMAX_LOCK_ONLY
    if infobits & XLHL_XMAX_EXCL_LOCK:
        infomask |= HEAP_XMAX_EXCL_LOCK
    if infobits & XLHL_XMAX_KEYSHR_LOCK:
        infomask |= HEAP_XMAX_KEYSHR_LOCK
    if infobits & XLHL_KEYS_UPDATED:
        infomask2 |= HEAP_KEYS_UPDATED
    return infomask, infomask2


def _set_ctid(page: bytearray, tup_off: int, blkno: int, offnum: int) -> None:
    _CTID.pack_into(page, tup_off + T_CTID, blkno >> 16, blkno & 0xFFFF, offnum)


def _set_cmax_first(page: bytearray, tup_off: int) -> None:
    """HeapTupleHeaderSetCmax(FirstCommandId, iscombo=false)."""
    _U32.pack_into(page, tup_off + T_CID, 0)
    (im,) = _U16.unpack_from(page, tup_off + T_INFOMASK)
    _U16.pack_into(page, tup_off + T_INFOMASK, im & ~HEAP_COMBOCID)


# --- Heap ---------------------------------------------------------------------------------


def redo_insert(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    offnum, flags = _need(rec.main_data, _XL_HEAP_INSERT, "heap insert", rec)
    if rec.xl_info & XLOG_HEAP_INIT_PAGE:
        bp.page_init(page, 0)
    data = blk.data
    if len(data) < _XL_HEAP_HEADER.size:
        raise RedoError("heap insert: block data shorter than xl_heap_header", lsn=rec.end_lsn)
    im2, im, hoff = _XL_HEAP_HEADER.unpack_from(data)
    _put_tuple(page, offnum, rec.xl_xid, 0, blk.blkno, im2, im, hoff, memoryview(data)[_XL_HEAP_HEADER.size :], rec)
    bp.page_set_lsn(page, rec.end_lsn)
    if flags & XLH_INSERT_ALL_VISIBLE_CLEARED:
        bp.page_clear_all_visible(page)
    if flags & XLH_INSERT_ALL_FROZEN_SET:
        bp.page_set_all_visible(page)


def redo_delete(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    xmax, offnum, infobits, flags = _need(rec.main_data, _XL_HEAP_DELETE, "heap delete", rec)
    off, _ = _normal_item(page, offnum, rec, "heap delete")
    im2, im = _INFOMASKS.unpack_from(page, off + T_INFOMASK2)
    im &= ~(HEAP_XMAX_BITS | HEAP_MOVED)
    im2 &= ~(HEAP_KEYS_UPDATED | HEAP_HOT_UPDATED)
    im, im2 = _fix_infomask_from_infobits(infobits, im, im2)
    _INFOMASKS.pack_into(page, off + T_INFOMASK2, im2, im)
    if not flags & XLH_DELETE_IS_SUPER:
        _U32.pack_into(page, off + T_XMAX, xmax)
    else:
        _U32.pack_into(page, off + T_XMIN, 0)
    _set_cmax_first(page, off)
    bp.page_set_prunable(page, rec.xl_xid)
    if flags & XLH_DELETE_ALL_VISIBLE_CLEARED:
        bp.page_clear_all_visible(page)
    if flags & XLH_DELETE_IS_PARTITION_MOVE:
        _CTID.pack_into(page, off + T_CTID, 0xFFFF, 0xFFFF, MOVED_PARTITIONS_OFFSET)
    else:
        _set_ctid(page, off, blk.blkno, offnum)
    bp.page_set_lsn(page, rec.end_lsn)


def update_blocks(rec: DecodedRecord) -> tuple[int, int]:
    """(old heap block, new heap block) of an UPDATE / HOT_UPDATE."""
    new = rec.block(0)
    if new is None:
        raise RedoError("heap update without block 0", lsn=rec.end_lsn)
    old = rec.block(1)
    return (old.blkno if old is not None else new.blkno), new.blkno


def redo_update(page: bytearray, rec: DecodedRecord, blk: BlockRef, hot: bool) -> None:
    """UPDATE / HOT_UPDATE on the page of ``blk``: block 1 is the old page (if not block 0)."""
    old_xmax, old_offnum, old_infobits, flags, new_xmax, new_offnum = _need(
        rec.main_data, _XL_HEAP_UPDATE, "heap update", rec
    )
    same_page = rec.block(1) is None
    old_tuple: tuple[int, int] | None = None
    if same_page or blk.block_id == 1:
        off, length = _normal_item(page, old_offnum, rec, "heap update (old tuple)")
        old_tuple = (off, length)
        im2, im = _INFOMASKS.unpack_from(page, off + T_INFOMASK2)
        im &= ~(HEAP_XMAX_BITS | HEAP_MOVED)
        im2 &= ~HEAP_KEYS_UPDATED
        im2 = im2 | HEAP_HOT_UPDATED if hot else im2 & ~HEAP_HOT_UPDATED
        im, im2 = _fix_infomask_from_infobits(old_infobits, im, im2)
        _INFOMASKS.pack_into(page, off + T_INFOMASK2, im2, im)
        _U32.pack_into(page, off + T_XMAX, old_xmax)
        _set_cmax_first(page, off)
        new_blk = rec.block(0)
        assert new_blk is not None
        _set_ctid(page, off, new_blk.blkno, new_offnum)
        bp.page_set_prunable(page, rec.xl_xid)
        if flags & XLH_UPDATE_OLD_ALL_VISIBLE_CLEARED:
            bp.page_clear_all_visible(page)
        bp.page_set_lsn(page, rec.end_lsn)
        if not same_page:
            return
    # the new tuple (block 0)
    if not same_page and rec.xl_info & XLOG_HEAP_INIT_PAGE:
        bp.page_init(page, 0)
    data = blk.data
    pos = 0
    prefixlen = suffixlen = 0
    if flags & XLH_UPDATE_PREFIX_FROM_OLD:
        (prefixlen,) = _U16.unpack_from(data, pos)
        pos += 2
    if flags & XLH_UPDATE_SUFFIX_FROM_OLD:
        (suffixlen,) = _U16.unpack_from(data, pos)
        pos += 2
    if len(data) < pos + _XL_HEAP_HEADER.size:
        raise RedoError("heap update: block data too short", lsn=rec.end_lsn)
    im2, im, hoff = _XL_HEAP_HEADER.unpack_from(data, pos)
    pos += _XL_HEAP_HEADER.size
    rest = data[pos:]
    if (prefixlen or suffixlen) and old_tuple is None:
        raise RedoError("heap update: prefix/suffix from an old tuple on another page", lsn=rec.end_lsn)
    if prefixlen > 0:
        assert old_tuple is not None
        ooff, _olen = old_tuple
        ohoff = page[ooff + T_HOFF]
        nbitmap = hoff - SIZEOF_HEAP_TUPLE_HEADER
        body = rest[:nbitmap] + page[ooff + ohoff : ooff + ohoff + prefixlen] + rest[nbitmap:]
    else:
        body = bytes(rest)
    if suffixlen > 0:
        assert old_tuple is not None
        ooff, olen = old_tuple
        body = body + page[ooff + olen - suffixlen : ooff + olen]
    _put_tuple(page, new_offnum, rec.xl_xid, new_xmax, blk.blkno, im2, im, hoff, body, rec)
    if flags & XLH_UPDATE_NEW_ALL_VISIBLE_CLEARED:
        bp.page_clear_all_visible(page)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_lock(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    xid, offnum, infobits, _flags = _need(rec.main_data, _XL_HEAP_LOCK, "heap lock", rec)
    off, _ = _normal_item(page, offnum, rec, "heap lock")
    im2, im = _INFOMASKS.unpack_from(page, off + T_INFOMASK2)
    im &= ~(HEAP_XMAX_BITS | HEAP_MOVED)
    im2 &= ~HEAP_KEYS_UPDATED
    im, im2 = _fix_infomask_from_infobits(infobits, im, im2)
    if (im & HEAP_XMAX_LOCK_ONLY) or (im & (HEAP_XMAX_IS_MULTI | HEAP_LOCK_MASK)) == HEAP_XMAX_EXCL_LOCK:
        im2 &= ~HEAP_HOT_UPDATED
        _set_ctid(page, off, blk.blkno, offnum)
    _INFOMASKS.pack_into(page, off + T_INFOMASK2, im2, im)
    _U32.pack_into(page, off + T_XMAX, xid)
    _set_cmax_first(page, off)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_lock_updated(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    xmax, offnum, infobits, _flags = _need(rec.main_data, _XL_HEAP_LOCK, "heap2 lock_updated", rec)
    off, _ = _normal_item(page, offnum, rec, "heap2 lock_updated")
    im2, im = _INFOMASKS.unpack_from(page, off + T_INFOMASK2)
    im &= ~(HEAP_XMAX_BITS | HEAP_MOVED)
    im2 &= ~HEAP_KEYS_UPDATED
    im, im2 = _fix_infomask_from_infobits(infobits, im, im2)
    _INFOMASKS.pack_into(page, off + T_INFOMASK2, im2, im)
    _U32.pack_into(page, off + T_XMAX, xmax)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_inplace(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if len(rec.main_data) < 2:
        raise RedoError("heap inplace: main data too short", lsn=rec.end_lsn)
    (offnum,) = _U16.unpack_from(rec.main_data)
    off, length = _normal_item(page, offnum, rec, "heap inplace")
    hoff = page[off + T_HOFF]
    if length - hoff != len(blk.data):
        raise RedoError(f"heap inplace: wrong tuple length {len(blk.data)} != {length - hoff}", lsn=rec.end_lsn)
    page[off + hoff : off + length] = blk.data
    bp.page_set_lsn(page, rec.end_lsn)


def redo_confirm(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if len(rec.main_data) < 2:
        raise RedoError("heap confirm: main data too short", lsn=rec.end_lsn)
    (offnum,) = _U16.unpack_from(rec.main_data)
    off, _ = _normal_item(page, offnum, rec, "heap confirm")
    _set_ctid(page, off, blk.blkno, offnum)
    bp.page_set_lsn(page, rec.end_lsn)


# --- Heap2 --------------------------------------------------------------------------------


def _offsets(data: bytes, count: int, start: int, rec: DecodedRecord) -> tuple[int, ...]:
    if len(data) < start + 2 * count:
        raise RedoError("offset array runs past the block data", lsn=rec.end_lsn)
    return struct.unpack_from(f"<{count}H", data, start)


def redo_prune(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    _xid, nredirected, ndead = _need(rec.main_data, _XL_HEAP_PRUNE, "heap2 prune", rec)
    data = blk.data
    total = len(data) // 2
    nunused = total - 2 * nredirected - ndead
    if nunused < 0:
        raise RedoError("heap2 prune: block data shorter than its counts", lsn=rec.end_lsn)
    offs = _offsets(data, total, 0, rec)
    maxoff = bp.max_offset(page)
    for i in range(nredirected):
        frm, to = offs[2 * i], offs[2 * i + 1]
        if not 1 <= frm <= maxoff:
            raise RedoError(f"heap2 prune: redirect from invalid offset {frm}", lsn=rec.end_lsn)
        bp.set_itemid(page, frm, to, bp.LP_REDIRECT, 0)
    base = 2 * nredirected
    for off in offs[base : base + ndead]:
        if not 1 <= off <= maxoff:
            raise RedoError(f"heap2 prune: dead at invalid offset {off}", lsn=rec.end_lsn)
        bp.set_itemid(page, off, 0, bp.LP_DEAD, 0)
    for off in offs[base + ndead :]:
        if not 1 <= off <= maxoff:
            raise RedoError(f"heap2 prune: unused at invalid offset {off}", lsn=rec.end_lsn)
        bp.set_itemid(page, off, 0, bp.LP_UNUSED, 0)
    bp.page_repair_fragmentation(page)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_vacuum(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if len(rec.main_data) < 2:
        raise RedoError("heap2 vacuum: main data too short", lsn=rec.end_lsn)
    (nunused,) = _U16.unpack_from(rec.main_data)
    maxoff = bp.max_offset(page)
    for off in _offsets(blk.data, nunused, 0, rec):
        if not 1 <= off <= maxoff:
            raise RedoError(f"heap2 vacuum: invalid offset {off}", lsn=rec.end_lsn)
        bp.set_itemid(page, off, 0, bp.LP_UNUSED, 0)
    bp.page_truncate_line_pointer_array(page)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_freeze_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    _cutoff, ntuples = _need(rec.main_data, _XL_HEAP_FREEZE_PAGE, "heap2 freeze_page", rec)
    data = blk.data
    if len(data) < ntuples * _XL_HEAP_FREEZE_TUPLE.size:
        raise RedoError("heap2 freeze_page: block data too short", lsn=rec.end_lsn)
    for i in range(ntuples):
        xmax, offnum, im2, im, frzflags = _XL_HEAP_FREEZE_TUPLE.unpack_from(data, i * 12)
        off = bp.item_offset(page, offnum)
        _U32.pack_into(page, off + T_XMAX, xmax)
        if frzflags & XLH_FREEZE_XVAC:
            _U32.pack_into(page, off + T_CID, 2)  # FrozenTransactionId
        if frzflags & XLH_INVALID_XVAC:
            _U32.pack_into(page, off + T_CID, 0)
        _INFOMASKS.pack_into(page, off + T_INFOMASK2, im2, im)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_visible(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    """Block 0 is the VM page (bits set, LSN stamped); block 1 the heap page (PD_ALL_VISIBLE).

    PostgreSQL stamps the heap page LSN only when hint bits are WAL-logged (data checksums or
    wal_log_hints). pagestore targets the default (neither), so the heap page LSN stays; it
    is masked in every comparison anyway.
    """
    _cutoff, flags = _need(rec.main_data, _XL_HEAP_VISIBLE, "heap2 visible", rec)
    if blk.block_id == 1:
        bp.page_set_all_visible(page)
        return
    heap = rec.block(1)
    if heap is None:
        raise RedoError("heap2 visible without the heap block", lsn=rec.end_lsn)
    if bp.page_is_new(page):
        bp.page_init(page, 0)
    if vm_set_in_page(page, heap.blkno, flags & VM_VALID_BITS):
        bp.page_set_lsn(page, rec.end_lsn)


def redo_multi_insert(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    """heap_xlog_multi_insert: the placement kernel parses the record's tuples and places
    them all in one call (a bulk load's heap pages are one or two of these records each)."""
    try:
        flags = placement.multi_insert(page, rec.main_data, blk.data, rec.xl_xid, blk.blkno, bool(rec.xl_info & XLOG_HEAP_INIT_PAGE))
    except PageError as exc:
        raise RedoError(str(exc), lsn=rec.end_lsn) from None
    bp.page_set_lsn(page, rec.end_lsn)
    if flags & XLH_INSERT_ALL_VISIBLE_CLEARED:
        bp.page_clear_all_visible(page)
    if flags & XLH_INSERT_ALL_FROZEN_SET:
        bp.page_set_all_visible(page)


def redo_heap(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    op = rec.xl_info & XLOG_HEAP_OPMASK
    if op == XLOG_HEAP_INSERT:
        redo_insert(page, rec, blk)
    elif op == XLOG_HEAP_HOT_UPDATE:
        redo_update(page, rec, blk, hot=True)
    elif op == XLOG_HEAP_UPDATE:
        redo_update(page, rec, blk, hot=False)
    elif op == XLOG_HEAP_DELETE:
        redo_delete(page, rec, blk)
    elif op == XLOG_HEAP_LOCK:
        redo_lock(page, rec, blk)
    elif op == XLOG_HEAP_INPLACE:
        redo_inplace(page, rec, blk)
    elif op == XLOG_HEAP_CONFIRM:
        redo_confirm(page, rec, blk)
    else:  # TRUNCATE has no block reference
        raise RedoError(f"Heap/{record_type_name(RmgrId.HEAP, op)} does not reference pages", lsn=rec.end_lsn, rmgr="Heap")


def redo_heap2(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    op = rec.xl_info & XLOG_HEAP_OPMASK
    if op == XLOG_HEAP2_PRUNE:
        redo_prune(page, rec, blk)
    elif op == XLOG_HEAP2_VACUUM:
        redo_vacuum(page, rec, blk)
    elif op == XLOG_HEAP2_FREEZE_PAGE:
        redo_freeze_page(page, rec, blk)
    elif op == XLOG_HEAP2_VISIBLE:
        redo_visible(page, rec, blk)
    elif op == XLOG_HEAP2_MULTI_INSERT:
        redo_multi_insert(page, rec, blk)
    elif op == XLOG_HEAP2_LOCK_UPDATED:
        redo_lock_updated(page, rec, blk)
    else:  # NEW_CID and REWRITE are for logical decoding only
        raise RedoError(f"Heap2/{record_type_name(RmgrId.HEAP2, op)} does not reference pages", lsn=rec.end_lsn, rmgr="Heap2")


def vm_clears(rec: DecodedRecord) -> list[tuple[int, int]]:
    """(heap block, VM bits) that a Heap/Heap2 record clears without referencing the VM page."""
    op = rec.xl_info & XLOG_HEAP_OPMASK
    main = rec.main_data
    b0 = rec.block(0)
    if b0 is None or not main:
        return []
    if rec.xl_rmid == RmgrId.HEAP:
        if op == XLOG_HEAP_INSERT:
            flags = main[2] if len(main) >= 3 else 0
            return [(b0.blkno, VM_VALID_BITS)] if flags & XLH_INSERT_ALL_VISIBLE_CLEARED else []
        if op == XLOG_HEAP_DELETE:
            flags = main[7] if len(main) >= 8 else 0
            return [(b0.blkno, VM_VALID_BITS)] if flags & XLH_DELETE_ALL_VISIBLE_CLEARED else []
        if op in (XLOG_HEAP_UPDATE, XLOG_HEAP_HOT_UPDATE) and len(main) >= 8:
            old, new = update_blocks(rec)
            out = []
            if main[7] & XLH_UPDATE_OLD_ALL_VISIBLE_CLEARED:
                out.append((old, VM_VALID_BITS))
            if main[7] & XLH_UPDATE_NEW_ALL_VISIBLE_CLEARED:
                out.append((new, VM_VALID_BITS))
            return out
        if op == XLOG_HEAP_LOCK:
            flags = main[7] if len(main) >= 8 else 0
            return [(b0.blkno, VM_ALL_FROZEN)] if flags & XLH_LOCK_ALL_FROZEN_CLEARED else []
    elif rec.xl_rmid == RmgrId.HEAP2:
        if op == XLOG_HEAP2_MULTI_INSERT:
            return [(b0.blkno, VM_VALID_BITS)] if main[0] & XLH_INSERT_ALL_VISIBLE_CLEARED else []
        if op == XLOG_HEAP2_LOCK_UPDATED:
            flags = main[7] if len(main) >= 8 else 0
            return [(b0.blkno, VM_ALL_FROZEN)] if flags & XLH_LOCK_ALL_FROZEN_CLEARED else []
    return []
