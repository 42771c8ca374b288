"""GIN (rmid 13) redo on one page: PostgreSQL 15's ``ginxlog.c``, block by block.

A GIN index is an entry tree (block 1 is its root) of ordinary index tuples, posting trees
(one per frequent key) whose leaves hold compressed TID segments, a metapage (block 0) and the
fast-update pending list. The manager calls ``redo_gin`` once per requested page with that
page's block reference; only the part of the routine for that block runs, reading the page,
the record's main data and the block's own data (never another block's data), so page-at-a-time
replay is exact.

Splits (SPLIT), entry-leaf vacuums (VACUUM_PAGE) and the pages of a split root come as forced
full-page images: the manager restores them before this module is asked. A missing image is an
error here, as in PostgreSQL. Posting-leaf changes go through ``gin_posting.recompress``.

The special area is 8 bytes at 8184: rightlink u32, maxoff u16, flags u16.
"""

from __future__ import annotations

import struct

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from pageserver.walredo.gin_posting import LEAF_DATA_MAX, LEAF_DATA_START, recompress
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import record_type_name

XLOG_GIN_CREATE_PTREE = 0x10
XLOG_GIN_INSERT = 0x20
XLOG_GIN_SPLIT = 0x30
XLOG_GIN_VACUUM_PAGE = 0x40
XLOG_GIN_DELETE_PAGE = 0x50
XLOG_GIN_UPDATE_META_PAGE = 0x60
XLOG_GIN_INSERT_LISTPAGE = 0x70
XLOG_GIN_DELETE_LISTPAGE = 0x80
XLOG_GIN_VACUUM_DATA_LEAF_PAGE = 0x90

GIN_DATA = 0x01
GIN_LEAF = 0x02
GIN_DELETED = 0x04
GIN_META = 0x08
GIN_LIST = 0x10
GIN_LIST_FULLROW = 0x20
GIN_INCOMPLETE_SPLIT = 0x40
GIN_COMPRESSED = 0x80

GIN_INSERT_ISDATA = 0x01
GIN_INSERT_ISLEAF = 0x02
GIN_SPLIT_ROOT = 0x04

GIN_OPAQUE_SIZE = 8
SPECIAL = bp.BLCKSZ - GIN_OPAQUE_SIZE
OFF_RIGHTLINK = SPECIAL
OFF_MAXOFF = SPECIAL + 4
OFF_FLAGS = SPECIAL + 6
INVALID_BLOCK = 0xFFFF_FFFF
GIN_CURRENT_VERSION = 2
META_START = bp.SIZE_OF_PAGE_HEADER
META_SIZE = 56  # sizeof(GinMetaPageData)
POSTING_ITEM_SIZE = 10  # child BlockIdData + key ItemPointerData
MAX_POSTING_ITEMS = LEAF_DATA_MAX // POSTING_ITEM_SIZE

_U16 = bp.U16
_U32 = bp.U32
_BLOCK_ID = struct.Struct("<HH")  # bi_hi, bi_lo
_INSERT_CHILDREN = struct.Struct("<HHHH")  # left child, right child (BlockIdData each)
_UPDATE_META_TAIL = struct.Struct("<IIi")  # prevTail, newRightlink, ntuples (at 72)
_INSERT_LISTPAGE = struct.Struct("<Ii")  # rightlink, ntuples
_DELETE_PAGE = struct.Struct("<HxxII")  # parentOffset, rightLink, deleteXid
_INSERT_ENTRY_HEAD = 4  # offsetof(ginxlogInsertEntry, tuple): offset u16, isDelete u8, pad
_INSERT_INTERNAL = struct.Struct("<H10s")  # offset, PostingItem
# logged sizes: sizeof() of the C structs, trailing padding included
UPDATE_META_SIZE = 88
DELETE_LISTPAGE_SIZE = 64
SPLIT_SIZE = 28


def _err(rec: DecodedRecord, msg: str) -> RedoError:
    name = record_type_name(rec.xl_rmid, rec.xl_info)
    return RedoError(f"Gin/{name}: {msg}", lsn=rec.end_lsn, rmgr="Gin")


def gin_flags(page: bytes | bytearray) -> int:
    v: int = _U16.unpack_from(page, OFF_FLAGS)[0]
    return v


def _set_flags(page: bytearray, flags: int) -> None:
    _U16.pack_into(page, OFF_FLAGS, flags)


def _maxoff(page: bytes | bytearray) -> int:
    v: int = _U16.unpack_from(page, OFF_MAXOFF)[0]
    return v


def gin_init_page(page: bytearray, flags: int) -> None:
    """GinInitPage: PageInit with an 8-byte special area, flags, rightlink invalid, maxoff 0."""
    bp.page_init(page, GIN_OPAQUE_SIZE)
    _U32.pack_into(page, OFF_RIGHTLINK, INVALID_BLOCK)
    _set_flags(page, flags)


def gin_init_metapage(page: bytearray, metadata: bytes | bytearray | memoryview) -> None:
    """GinInitMetabuffer, then the logged GinMetaPageData copied over it (its 56 bytes)."""
    gin_init_page(page, GIN_META)
    page[META_START : META_START + META_SIZE] = metadata
    bp.set_lower(page, META_START + META_SIZE)


def _check_gin_page(page: bytearray, rec: DecodedRecord, want: int, unwanted: int, what: str) -> int:
    """The page must be a GIN page with the ``want`` flags and none of ``unwanted``."""
    if bp.get_special(page) != SPECIAL:
        raise _err(rec, f"{what}: not a GIN page (pd_special {bp.get_special(page)})")
    flags = gin_flags(page)
    if flags & want != want or flags & unwanted:
        raise _err(rec, f"{what}: page flags {flags:#x} do not fit the record")
    return flags


def _add(page: bytearray, tup: bytes | bytearray | memoryview, offnum: int, rec: DecodedRecord, what: str) -> None:
    if bp.page_add_item(page, tup, offnum, overwrite=False, is_heap=False) != offnum:
        raise _err(rec, f"failed to add {what} at offset {offnum}")


def _tuple_size(buf: bytes | bytearray | memoryview, pos: int, end: int, rec: DecodedRecord) -> int:
    if pos + 8 > end:
        raise _err(rec, f"truncated index tuple at {pos} of {end} bytes")
    size: int = _U16.unpack_from(buf, pos + 6)[0] & 0x1FFF
    if size < 8 or pos + size > end:
        raise _err(rec, f"index tuple of {size} bytes at {pos} does not fit {end} bytes")
    return size


def _append_tuples(page: bytearray, data: bytes, ntuples: int, off: int, rec: DecodedRecord) -> None:
    """Add ``ntuples`` concatenated (unaligned) index tuples from ``off`` on; the data must hold
    exactly those tuples."""
    pos = 0
    end = len(data)
    for i in range(ntuples):
        size = _tuple_size(data, pos, end, rec)
        _add(page, data[pos : pos + size], off + i, rec, "list tuple")
        pos += size
    if pos != end:
        raise _err(rec, f"{end - pos} bytes left after {ntuples} tuples")


def _clear_incomplete_split(page: bytearray, rec: DecodedRecord) -> None:
    flags = _check_gin_page(page, rec, 0, GIN_DELETED, "child of a finished split")
    _set_flags(page, flags & ~GIN_INCOMPLETE_SPLIT)


# --- records ------------------------------------------------------------------------------


def _create_ptree(page: bytearray, rec: DecodedRecord) -> None:
    main = rec.main_data
    if len(main) < 4:
        raise _err(rec, "CREATE_PTREE without its size")
    (size,) = _U32.unpack_from(main, 0)
    if size > LEAF_DATA_MAX or len(main) < 4 + size:
        raise _err(rec, f"CREATE_PTREE of {size} bytes ({len(main) - 4} logged)")
    gin_init_page(page, GIN_DATA | GIN_LEAF | GIN_COMPRESSED)
    page[LEAF_DATA_START : LEAF_DATA_START + size] = main[4 : 4 + size]
    bp.set_lower(page, LEAF_DATA_START + size)


def _insert_entry(page: bytearray, data: bytes, isleaf: bool, rightblk: int, rec: DecodedRecord) -> None:
    """ginRedoInsertEntry: an entry-tree tuple at ``offset`` (after the downlink update of a
    finished child split, or replacing the old leaf tuple when isDelete)."""
    _check_gin_page(page, rec, GIN_LEAF if isleaf else 0, GIN_DATA | (0 if isleaf else GIN_LEAF), "entry insert")
    if len(data) < _INSERT_ENTRY_HEAD:
        raise _err(rec, "entry insert without its header")
    (offset,) = _U16.unpack_from(data, 0)
    is_delete = data[2]
    tup = data[_INSERT_ENTRY_HEAD:]
    if _tuple_size(tup, 0, len(tup), rec) != len(tup):
        raise _err(rec, f"entry insert carries {len(tup)} bytes for its tuple")
    if not isleaf:
        pos = bp.item_offset(page, offset)
        _BLOCK_ID.pack_into(page, pos, rightblk >> 16, rightblk & 0xFFFF)
        _U16.pack_into(page, pos + 4, 0)
    if is_delete:
        if not isleaf:
            raise _err(rec, "entry insert replaces a tuple on an internal page")
        bp.page_index_tuple_delete(page, offset)
    _add(page, tup, offset, rec, "entry tuple")


def _posting_item_pos(i: int) -> int:
    return LEAF_DATA_START + (i - 1) * POSTING_ITEM_SIZE


def _set_data_size(page: bytearray, size: int) -> None:
    bp.set_lower(page, LEAF_DATA_START + size)


def _insert_data_internal(page: bytearray, data: bytes, rightblk: int, rec: DecodedRecord) -> None:
    """ginRedoInsertData on an internal posting-tree page: the old downlink at ``offset`` now
    points at the split's right page and the new item (pointing left) goes before it."""
    _check_gin_page(page, rec, GIN_DATA, GIN_LEAF, "posting tree internal insert")
    if len(data) != _INSERT_INTERNAL.size:
        raise _err(rec, f"internal posting insert of {len(data)} bytes")
    offset, item = _INSERT_INTERNAL.unpack_from(data, 0)
    maxoff = _maxoff(page)
    if not 1 <= offset <= maxoff or maxoff + 1 > MAX_POSTING_ITEMS:
        raise _err(rec, f"posting item offset {offset} on a page of {maxoff}")
    pos = _posting_item_pos(offset)
    _BLOCK_ID.pack_into(page, pos, rightblk >> 16, rightblk & 0xFFFF)
    end = _posting_item_pos(maxoff + 1)
    page[pos + POSTING_ITEM_SIZE : end + POSTING_ITEM_SIZE] = page[pos:end]
    page[pos : pos + POSTING_ITEM_SIZE] = item
    _U16.pack_into(page, OFF_MAXOFF, maxoff + 1)
    _set_data_size(page, (maxoff + 1) * POSTING_ITEM_SIZE)


def _insert(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    main = rec.main_data
    if len(main) < 2:
        raise _err(rec, "INSERT without flags")
    (flags,) = _U16.unpack_from(main, 0)
    isleaf = bool(flags & GIN_INSERT_ISLEAF)
    rightblk = INVALID_BLOCK
    if not isleaf:
        if len(main) < 2 + _INSERT_CHILDREN.size:
            raise _err(rec, "INSERT on an internal page without its child block numbers")
        _lhi, _llo, rhi, rlo = _INSERT_CHILDREN.unpack_from(main, 2)
        rightblk = (rhi << 16) | rlo
    bid = blk.block_id
    if bid == 1 and not isleaf:
        _clear_incomplete_split(page, rec)
        return
    if bid != 0:
        raise _err(rec, f"INSERT has no block {bid}")
    data = blk.data
    if flags & GIN_INSERT_ISDATA:
        if isleaf:
            _check_gin_page(page, rec, GIN_DATA | GIN_LEAF, 0, "posting leaf insert")
            recompress(page, data)
        else:
            _insert_data_internal(page, data, rightblk, rec)
    else:
        _insert_entry(page, data, isleaf, rightblk, rec)


def _delete_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    main = rec.main_data
    if len(main) < _DELETE_PAGE.size:
        raise _err(rec, "truncated DELETE_PAGE")
    parent_off, rightlink, delete_xid = _DELETE_PAGE.unpack_from(main, 0)
    bid = blk.block_id
    if bid == 2:  # left sibling
        _check_gin_page(page, rec, GIN_DATA, 0, "left sibling of a deleted page")
        _U32.pack_into(page, OFF_RIGHTLINK, rightlink)
    elif bid == 0:  # the deleted page keeps its content
        flags = _check_gin_page(page, rec, GIN_DATA, 0, "deleted page")
        _set_flags(page, flags | GIN_DELETED)
        bp.set_prune_xid(page, delete_xid)
    elif bid == 1:  # parent: GinPageDeletePostingItem
        _check_gin_page(page, rec, GIN_DATA, GIN_LEAF, "parent of a deleted page")
        maxoff = _maxoff(page)
        if not 1 <= parent_off <= maxoff or maxoff > MAX_POSTING_ITEMS:
            raise _err(rec, f"posting item offset {parent_off} on a page of {maxoff}")
        pos = _posting_item_pos(parent_off)
        end = _posting_item_pos(maxoff + 1)
        page[pos : end - POSTING_ITEM_SIZE] = page[pos + POSTING_ITEM_SIZE : end]
        _U16.pack_into(page, OFF_MAXOFF, maxoff - 1)
        _set_data_size(page, (maxoff - 1) * POSTING_ITEM_SIZE)
    else:
        raise _err(rec, f"DELETE_PAGE has no block {bid}")


def _update_meta(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    main = rec.main_data
    if len(main) < UPDATE_META_SIZE:
        raise _err(rec, f"UPDATE_META_PAGE of {len(main)} bytes")
    bid = blk.block_id
    if bid == 0:
        # re-initialized from the logged metadata, whatever the page held (like an image)
        gin_init_metapage(page, main[16 : 16 + META_SIZE])
        return
    if bid != 1:
        raise _err(rec, f"UPDATE_META_PAGE has no block {bid}")
    prev_tail, new_rightlink, ntuples = _UPDATE_META_TAIL.unpack_from(main, 72)
    flags = _check_gin_page(page, rec, GIN_LIST, 0, "pending-list tail")
    if ntuples > 0:
        off = 1 if bp.get_lower(page) <= bp.SIZE_OF_PAGE_HEADER else bp.max_offset(page) + 1
        _append_tuples(page, blk.data, ntuples, off, rec)
        _U16.pack_into(page, OFF_MAXOFF, (_maxoff(page) + 1) & 0xFFFF)
    elif prev_tail != INVALID_BLOCK:
        _U32.pack_into(page, OFF_RIGHTLINK, new_rightlink)
    else:
        raise _err(rec, f"UPDATE_META_PAGE changes no tail page (flags {flags:#x})")


def _insert_listpage(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _err(rec, f"INSERT_LISTPAGE has no block {blk.block_id}")
    main = rec.main_data
    if len(main) < _INSERT_LISTPAGE.size:
        raise _err(rec, "truncated INSERT_LISTPAGE")
    rightlink, ntuples = _INSERT_LISTPAGE.unpack_from(main, 0)
    if ntuples < 0:
        raise _err(rec, f"INSERT_LISTPAGE of {ntuples} tuples")
    gin_init_page(page, GIN_LIST)
    _U32.pack_into(page, OFF_RIGHTLINK, rightlink)
    if rightlink == INVALID_BLOCK:  # tail of a sublist: its last heap row ends here
        _set_flags(page, GIN_LIST | GIN_LIST_FULLROW)
        _U16.pack_into(page, OFF_MAXOFF, 1)
    _append_tuples(page, blk.data, ntuples, 1, rec)


def _delete_listpage(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    main = rec.main_data
    if len(main) < DELETE_LISTPAGE_SIZE:
        raise _err(rec, f"DELETE_LISTPAGE of {len(main)} bytes")
    (ndeleted,) = bp.I32.unpack_from(main, META_SIZE)
    bid = blk.block_id
    if bid == 0:
        gin_init_metapage(page, main[:META_SIZE])
    elif 1 <= bid <= ndeleted:
        # the primary only set DELETED and kept the rows; redo leaves an empty page
        gin_init_page(page, GIN_DELETED)
    else:
        raise _err(rec, f"DELETE_LISTPAGE of {ndeleted} pages has no block {bid}")


def redo_gin(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    try:
        _redo(page, rec, blk)
    except RedoError as exc:
        if exc.lsn is None:  # from gin_posting, which does not know the record
            raise _err(rec, exc.msg) from None
        raise


def _redo(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    info = rec.xl_info & 0xF0
    bid = blk.block_id
    if info == XLOG_GIN_INSERT:
        _insert(page, rec, blk)
    elif info == XLOG_GIN_UPDATE_META_PAGE:
        _update_meta(page, rec, blk)
    elif info == XLOG_GIN_VACUUM_DATA_LEAF_PAGE:
        if bid != 0:
            raise _err(rec, f"VACUUM_DATA_LEAF_PAGE has no block {bid}")
        _check_gin_page(page, rec, GIN_DATA | GIN_LEAF, 0, "posting leaf vacuum")
        recompress(page, blk.data)
    elif info == XLOG_GIN_CREATE_PTREE:
        if bid != 0:
            raise _err(rec, f"CREATE_PTREE has no block {bid}")
        _create_ptree(page, rec)
    elif info == XLOG_GIN_INSERT_LISTPAGE:
        _insert_listpage(page, rec, blk)
    elif info == XLOG_GIN_DELETE_LISTPAGE:
        _delete_listpage(page, rec, blk)
    elif info == XLOG_GIN_DELETE_PAGE:
        _delete_page(page, rec, blk)
    elif info == XLOG_GIN_SPLIT:
        main = rec.main_data
        if len(main) < SPLIT_SIZE:
            raise _err(rec, "truncated SPLIT")
        (flags,) = _U16.unpack_from(main, 24)
        if bid == 3 and not flags & GIN_INSERT_ISLEAF:  # the child whose split this finishes
            _clear_incomplete_split(page, rec)
        else:
            raise _err(rec, f"SPLIT block {bid} did not carry its full-page image")
    elif info == XLOG_GIN_VACUUM_PAGE:
        raise _err(rec, "VACUUM_PAGE did not carry its full-page image")
    else:
        raise _err(rec, f"unknown record type {info:#x}")
    bp.page_set_lsn(page, rec.end_lsn)


def gin_mask(page: bytearray, blkno: int) -> None:
    """gin_mask: LSN, checksum and hint bits; a deleted page's whole content (redo empties a
    deleted list page the primary left full); else the free space when pd_lower is set."""
    # imported here: mask.py registers this function, so it imports this module first
    from pageserver.walredo import mask as bufmask

    bufmask.mask_page_lsn_and_checksum(page)
    bufmask.mask_page_hint_bits(page)
    special = bp.get_special(page)
    if special > bp.BLCKSZ - GIN_OPAQUE_SIZE:
        raise RedoError(f"GIN page with pd_special {special}")
    if _U16.unpack_from(page, special + 6)[0] & GIN_DELETED:
        bufmask.mask_page_content(page)
    elif bp.get_lower(page) > bp.SIZE_OF_PAGE_HEADER:
        bufmask.mask_unused_space(page)
