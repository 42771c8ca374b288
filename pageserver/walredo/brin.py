"""BRIN (rmid 17) redo on one page: PostgreSQL 15's ``brin_xlog.c``, block by block.

A BRIN index is a metapage (block 0), revmap pages (blocks 1..lastRevmapPage: one
ItemPointer per page range, pointing at its summary tuple) and regular pages holding the
summary tuples (opaque to redo). Tuple offsets must stay stable because the revmap names them,
so deletions never compact line pointers (PageIndexTupleDeleteNoCompact) and inserts put the
tuple at the logged offset in overwrite mode.

The manager calls ``redo_brin`` once per requested page with that page's block reference.
INSERT and UPDATE write the new tuple's TID into the revmap: its block number is the *number*
of block 0 of the same record, read from that block's tag, never from its data.

The special area is 8 bytes at 8184: u16 vector[4], vector[2] = flags, vector[3] = page type.
"""

from __future__ import annotations

import struct

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import record_type_name

XLOG_BRIN_CREATE_INDEX = 0x00
XLOG_BRIN_INSERT = 0x10
XLOG_BRIN_UPDATE = 0x20
XLOG_BRIN_SAMEPAGE_UPDATE = 0x30
XLOG_BRIN_REVMAP_EXTEND = 0x40
XLOG_BRIN_DESUMMARIZE = 0x50
XLOG_BRIN_OPMASK = 0x70
XLOG_BRIN_INIT_PAGE = 0x80

BRIN_PAGETYPE_META = 0xF091
BRIN_PAGETYPE_REVMAP = 0xF092
BRIN_PAGETYPE_REGULAR = 0xF093
BRIN_EVACUATE_PAGE = 0x0001
BRIN_META_MAGIC = 0xA8109CFA

BRIN_SPECIAL_SIZE = 8
SPECIAL = bp.BLCKSZ - BRIN_SPECIAL_SIZE
OFF_FLAGS = SPECIAL + 4
OFF_TYPE = SPECIAL + 6
META_START = bp.SIZE_OF_PAGE_HEADER
META = struct.Struct("<IIII")  # brinMagic, brinVersion, pagesPerRange, lastRevmapPage
REVMAP_START = bp.SIZE_OF_PAGE_HEADER
REVMAP_PAGE_MAXITEMS = (SPECIAL - REVMAP_START) // 6  # 1360

_U16 = bp.U16
_U32 = bp.U32
_TID = struct.Struct("<HHH")  # bi_hi, bi_lo, posid
_CREATEIDX = struct.Struct("<IH")  # pagesPerRange, version
_INSERT = struct.Struct("<IIH")  # heapBlk, pagesPerRange, offnum
_UPDATE_OLD = struct.Struct("<H")  # oldOffnum; the insert struct follows at 4
_DESUMMARIZE = struct.Struct("<IIH")  # pagesPerRange, heapBlk, regOffset
INVALID_BLOCK = 0xFFFF_FFFF


def _err(rec: DecodedRecord, msg: str) -> RedoError:
    name = record_type_name(rec.xl_rmid, rec.xl_info)
    return RedoError(f"BRIN/{name}: {msg}", lsn=rec.end_lsn, rmgr="BRIN")


def brin_page_type(page: bytes | bytearray) -> int:
    v: int = _U16.unpack_from(page, bp.get_special(page) + 6)[0]
    return v


def brin_page_init(page: bytearray, page_type: int) -> None:
    bp.page_init(page, BRIN_SPECIAL_SIZE)
    _U16.pack_into(page, OFF_TYPE, page_type)


def brin_metapage_init(page: bytearray, pages_per_range: int, version: int) -> None:
    brin_page_init(page, BRIN_PAGETYPE_META)
    META.pack_into(page, META_START, BRIN_META_MAGIC, version, pages_per_range, 0)
    bp.set_lower(page, META_START + META.size)


def _check_type(page: bytearray, want: int, rec: DecodedRecord, what: str) -> None:
    if bp.get_special(page) != SPECIAL or _U16.unpack_from(page, OFF_TYPE)[0] != want:
        raise _err(rec, f"{what}: page is not a BRIN page of type {want:#x}")


def _set_revmap_entry(page: bytearray, pages_per_range: int, heap_blk: int, blkno: int, offnum: int, rec: DecodedRecord) -> None:
    """brinSetHeapBlockItemptr: the revmap slot of ``heap_blk``'s range on this page."""
    _check_type(page, BRIN_PAGETYPE_REVMAP, rec, "revmap update")
    if pages_per_range == 0:
        raise _err(rec, "pagesPerRange 0")
    pos = REVMAP_START + 6 * ((heap_blk // pages_per_range) % REVMAP_PAGE_MAXITEMS)
    _TID.pack_into(page, pos, blkno >> 16, blkno & 0xFFFF, offnum)


def _insert_update(page: bytearray, rec: DecodedRecord, blk: BlockRef, pos: int) -> None:
    """brin_xlog_insert_update, for block 0 (the tuple) or 1 (the revmap)."""
    main = rec.main_data
    if len(main) < pos + _INSERT.size:
        raise _err(rec, f"truncated insert data ({len(main)} bytes)")
    heap_blk, pages_per_range, offnum = _INSERT.unpack_from(main, pos)
    bid = blk.block_id
    if bid == 0:
        if rec.xl_info & XLOG_BRIN_INIT_PAGE:
            brin_page_init(page, BRIN_PAGETYPE_REGULAR)
        else:
            _check_type(page, BRIN_PAGETYPE_REGULAR, rec, "summary insert")
        tup = blk.data
        if len(tup) < 5:
            raise _err(rec, f"summary tuple of {len(tup)} bytes")
        if _U32.unpack_from(tup, 0)[0] != heap_blk:
            raise _err(rec, "summary tuple is not for the logged heap block")
        if offnum == 0 or offnum > bp.max_offset(page) + 1:
            raise _err(rec, f"invalid offset {offnum} (max {bp.max_offset(page)})")
        if bp.page_add_item(page, tup, offnum, overwrite=True, is_heap=False) != offnum:
            raise _err(rec, f"failed to add the summary tuple at offset {offnum}")
    elif bid == 1:
        target = rec.block(0)
        if target is None:
            raise _err(rec, "insert without the regular page block")
        _set_revmap_entry(page, pages_per_range, heap_blk, target.blkno, offnum, rec)
    else:
        raise _err(rec, f"insert has no block {bid}")


# the logged size of each record's main data (SizeOf..., without trailing padding)
_MAIN_SIZE = {
    XLOG_BRIN_CREATE_INDEX: _CREATEIDX.size,
    XLOG_BRIN_INSERT: _INSERT.size,
    XLOG_BRIN_UPDATE: 4 + _INSERT.size,
    XLOG_BRIN_SAMEPAGE_UPDATE: 2,
    XLOG_BRIN_REVMAP_EXTEND: 4,
    XLOG_BRIN_DESUMMARIZE: _DESUMMARIZE.size,
}


def redo_brin(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    info = rec.xl_info & XLOG_BRIN_OPMASK
    bid = blk.block_id
    main = rec.main_data
    need = _MAIN_SIZE.get(info)
    if need is None:
        raise _err(rec, f"unknown record type {rec.xl_info & 0xF0:#x}")
    if len(main) < need:
        # whichever block is asked for: a record cut short is not replayed on any of them
        raise _err(rec, f"main data of {len(main)} bytes, {need} expected")
    if info == XLOG_BRIN_INSERT:
        _insert_update(page, rec, blk, 0)
    elif info == XLOG_BRIN_SAMEPAGE_UPDATE:
        if bid != 0 or len(main) < 2:
            raise _err(rec, f"SAMEPAGE_UPDATE block {bid} with {len(main)} bytes of main data")
        _check_type(page, BRIN_PAGETYPE_REGULAR, rec, "same-page update")
        (offnum,) = _U16.unpack_from(main, 0)
        if not blk.data:
            raise _err(rec, "same-page update without its tuple")
        if not bp.page_index_tuple_overwrite(page, offnum, blk.data):
            raise _err(rec, f"failed to replace the tuple at offset {offnum}")
    elif info == XLOG_BRIN_UPDATE:
        if bid == 2:
            if len(main) < 2:
                raise _err(rec, "truncated UPDATE")
            _check_type(page, BRIN_PAGETYPE_REGULAR, rec, "old tuple removal")
            bp.page_index_tuple_delete_no_compact(page, _UPDATE_OLD.unpack_from(main, 0)[0])
        else:
            _insert_update(page, rec, blk, 4)
    elif info == XLOG_BRIN_CREATE_INDEX:
        if bid != 0 or len(main) < _CREATEIDX.size:
            raise _err(rec, f"CREATE_INDEX block {bid} with {len(main)} bytes of main data")
        pages_per_range, version = _CREATEIDX.unpack_from(main, 0)
        brin_metapage_init(page, pages_per_range, version)
    elif info == XLOG_BRIN_REVMAP_EXTEND:
        if len(main) < 4:
            raise _err(rec, "truncated REVMAP_EXTEND")
        (target,) = _U32.unpack_from(main, 0)
        if bid == 0:
            _check_type(page, BRIN_PAGETYPE_META, rec, "revmap extension")
            _U32.pack_into(page, META_START + 12, target)
            bp.set_lower(page, META_START + META.size)
        elif bid == 1:
            if blk.blkno != target:
                raise _err(rec, f"REVMAP_EXTEND of block {target} names block {blk.blkno}")
            brin_page_init(page, BRIN_PAGETYPE_REVMAP)
        else:
            raise _err(rec, f"REVMAP_EXTEND has no block {bid}")
    elif info == XLOG_BRIN_DESUMMARIZE:
        if len(main) < _DESUMMARIZE.size:
            raise _err(rec, "truncated DESUMMARIZE")
        pages_per_range, heap_blk, reg_offset = _DESUMMARIZE.unpack_from(main, 0)
        if bid == 0:
            _set_revmap_entry(page, pages_per_range, heap_blk, INVALID_BLOCK, 0, rec)
        elif bid == 1:
            _check_type(page, BRIN_PAGETYPE_REGULAR, rec, "desummarize")
            bp.page_index_tuple_delete_no_compact(page, reg_offset)
        else:
            raise _err(rec, f"DESUMMARIZE has no block {bid}")
    else:
        raise _err(rec, f"unknown record type {rec.xl_info & 0xF0:#x}")
    bp.page_set_lsn(page, rec.end_lsn)


def brin_mask(page: bytearray, blkno: int) -> None:
    """brin_mask: LSN, checksum, hint bits; free space of regular pages and of a metapage whose
    pd_lower is set (never of revmap pages: their "hole" is the revmap); EVACUATE_PAGE, which
    is set without WAL."""
    # imported here: mask.py registers this function, so it imports this module first
    from pageserver.walredo import mask as bufmask

    bufmask.mask_page_lsn_and_checksum(page)
    bufmask.mask_page_hint_bits(page)
    special = bp.get_special(page)
    if special > SPECIAL:
        raise RedoError(f"BRIN page with pd_special {special}")
    page_type = _U16.unpack_from(page, special + 6)[0]
    if page_type == BRIN_PAGETYPE_REGULAR or (
        page_type == BRIN_PAGETYPE_META and bp.get_lower(page) > bp.SIZE_OF_PAGE_HEADER
    ):
        bufmask.mask_unused_space(page)
    flags = _U16.unpack_from(page, special + 4)[0]
    _U16.pack_into(page, special + 4, flags & ~BRIN_EVACUATE_PAGE)
