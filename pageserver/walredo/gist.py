"""GiST (rmid 14) redo on one page: PostgreSQL 15's ``gistxlog.c``, block by block.

A page split logs every resulting page whole (WILL_INIT, block data = i32 count + index
tuples); PAGE_UPDATE carries deletions and insertions as block 0's data; DELETE (insert-time
removal of LP_DEAD tuples) keeps its offsets in the main data; PAGE_DELETE marks an empty leaf
deleted and drops its downlink from the parent. PAGE_REUSE and ASSIGN_LSN reference no page.

The split protocol: when the parent receives the downlink of a split page (a PAGE_UPDATE
with block 1, or a PAGE_SPLIT with block 0), that left child gets NSN = the record's end LSN
and loses F_FOLLOW_RIGHT. The primary changes the child after logging it, so its image does
not hold the change: redo applies it on top of a restored image too (``redo_gist_on_image``,
PostgreSQL's BLK_RESTORED branch of ``gistRedoClearFollowRight``).

F_TUPLES_DELETED: the 15.18 sources set it on a leaf page in redo of PAGE_UPDATE with
deletions (as the primary's VACUUM does) and of DELETE (which the primary's insert-time
pruning does not); later 15.x leave it alone everywhere. No code reads the flag any more;
redo here follows the primary of 15.18 (``MARK_TUPLES_DELETED``: set on PAGE_UPDATE deletions
on a leaf, never on DELETE) and ``gist_mask`` ignores it so WAL of either release validates.
"""

from __future__ import annotations

import struct

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_GIST_DELETE,
    XLOG_GIST_PAGE_DELETE,
    XLOG_GIST_PAGE_SPLIT,
    XLOG_GIST_PAGE_UPDATE,
    RmgrId,
    record_type_name,
)

F_LEAF = 1 << 0
F_DELETED = 1 << 1
F_TUPLES_DELETED = 1 << 2
F_FOLLOW_RIGHT = 1 << 3
F_HAS_GARBAGE = 1 << 4
GIST_PAGE_ID = 0xFF81
SIZEOF_GIST_OPAQUE = 16
GIST_ROOT_BLKNO = 0
INVALID_BLOCK = 0xFFFF_FFFF
INDEX_SIZE_MASK = 0x1FFF
SIZEOF_INDEX_TUPLE = 8

# Whether redo of PAGE_UPDATE with deletions on a leaf sets F_TUPLES_DELETED, as 15.18's
# VACUUM does on the primary (module docstring).
MARK_TUPLES_DELETED = True

_U16 = bp.U16
_OPAQUE_POS = bp.BLCKSZ - SIZEOF_GIST_OPAQUE
# nsn (xlogid, xrecoff), rightlink, flags, gist_page_id
_OPAQUE = struct.Struct("<IIIHH")
_FLAGS_POS = _OPAQUE_POS + 12
_PAGE_UPDATE = struct.Struct("<HH")  # ntodelete, ntoinsert
_DELETE = struct.Struct("<IH")  # latestRemovedXid, ntodelete (then the offsets)
_PAGE_SPLIT = struct.Struct("<I4xQBxHB3x")  # origrlink, orignsn, origleaf, npage, markfollowright
_PAGE_DELETE = struct.Struct("<QH")  # deleteXid (FullTransactionId), downlinkOffset
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")


def _name(rec: DecodedRecord) -> str:
    return f"Gist/{record_type_name(RmgrId.GIST, rec.xl_info)}"


def _err(rec: DecodedRecord, msg: str) -> RedoError:
    return RedoError(f"{_name(rec)}: {msg}", lsn=rec.end_lsn, rmgr="Gist")


def _main(rec: DecodedRecord, st: struct.Struct) -> tuple[int, ...]:
    if len(rec.main_data) < st.size:
        raise _err(rec, f"main data is {len(rec.main_data)} bytes, needs {st.size}")
    v: tuple[int, ...] = st.unpack_from(rec.main_data, 0)
    return v


# --- page helpers -----------------------------------------------------------------------


def init_page(page: bytearray, flags: int) -> None:
    """gistinitpage: PageInit with a 16-byte special area; NSN 0, no right link."""
    bp.page_init(page, SIZEOF_GIST_OPAQUE)
    _OPAQUE.pack_into(page, _OPAQUE_POS, 0, 0, INVALID_BLOCK, flags, GIST_PAGE_ID)


def _check_special(page: bytearray, rec: DecodedRecord) -> None:
    if bp.get_special(page) != _OPAQUE_POS:
        raise _err(rec, f"page special area at {bp.get_special(page)} is not a GiST one")


def get_flags(page: bytes | bytearray) -> int:
    v: int = _U16.unpack_from(page, _FLAGS_POS)[0]
    return v


def _set_flags(page: bytearray, flags: int) -> None:
    _U16.pack_into(page, _FLAGS_POS, flags)


def _set_nsn(page: bytearray, nsn: int) -> None:
    bp.LSN_HALVES.pack_into(page, _OPAQUE_POS, nsn >> 32, nsn & 0xFFFF_FFFF)


def _tuples(data: bytes, pos: int, rec: DecodedRecord, what: str) -> list[bytes]:
    """Concatenated index tuples from ``pos`` to the end of ``data``."""
    out: list[bytes] = []
    end = len(data)
    while pos < end:
        if pos + SIZEOF_INDEX_TUPLE > end:
            raise _err(rec, f"{what}: truncated index tuple header")
        size = _U16.unpack_from(data, pos + 6)[0] & INDEX_SIZE_MASK
        if size < SIZEOF_INDEX_TUPLE or pos + size > end:
            raise _err(rec, f"{what}: index tuple of {size} bytes does not fit")
        out.append(bytes(data[pos : pos + size]))
        pos += size
    return out


def _add_tuples(page: bytearray, tuples: list[bytes], off: int, rec: DecodedRecord) -> None:
    """gistfillbuffer from ``off`` = maxoff + 1 (appending never shuffles: one bulk write)."""
    if off != bp.max_offset(page) + 1:
        raise _err(rec, f"cannot append at offset {off} (max {bp.max_offset(page)})")
    if not bp.page_append_items(page, tuples):
        raise _err(rec, f"failed to add {len(tuples)} items to GiST index page")


def clear_follow_right(page: bytearray, rec: DecodedRecord) -> None:
    """gistRedoClearFollowRight on the left child: NSN = this record's LSN."""
    _check_special(page, rec)
    _set_nsn(page, rec.end_lsn)
    _set_flags(page, get_flags(page) & ~F_FOLLOW_RIGHT)


def _offsets(data: bytes, pos: int, n: int, rec: DecodedRecord, what: str) -> tuple[int, ...]:
    if pos + 2 * n > len(data):
        raise _err(rec, f"{what}: {n} offsets do not fit in {len(data)} bytes")
    v: tuple[int, ...] = struct.unpack_from(f"<{n}H", data, pos)
    return v


# --- records ----------------------------------------------------------------------------


def _page_update(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    ntodelete, ntoinsert = _main(rec, _PAGE_UPDATE)
    if blk.block_id == 1:
        clear_follow_right(page, rec)
        return
    if blk.block_id != 0:
        raise _err(rec, f"has no block {blk.block_id}")
    _check_special(page, rec)
    data = blk.data
    if ntodelete == 1 and ntoinsert == 1:
        # one tuple replaced by another: PageIndexTupleOverwrite, as gistplacetopage did
        (offnum,) = _offsets(data, 0, 1, rec, "replaced tuple")
        tuples = _tuples(data, 2, rec, "replacement tuple")
        if len(tuples) != 1:
            raise _err(rec, f"{len(tuples)} tuples logged for a one-for-one replacement")
        if not bp.page_index_tuple_overwrite(page, offnum, tuples[0]):
            raise _err(rec, f"failed to add item to GiST index page, size {len(tuples[0])} bytes")
        return
    todelete = _offsets(data, 0, ntodelete, rec, "todelete")
    tuples = _tuples(data, 2 * ntodelete, rec, "new tuples")
    if len(tuples) != ntoinsert:
        raise _err(rec, f"{len(tuples)} tuples logged, the record says {ntoinsert}")
    if ntodelete:
        bp.page_index_multi_delete(page, todelete)
        flags = get_flags(page)
        if MARK_TUPLES_DELETED and flags & F_LEAF:
            _set_flags(page, flags | F_TUPLES_DELETED)
    if tuples:
        maxoff = bp.max_offset(page)
        _add_tuples(page, tuples, maxoff + 1, rec)


def _delete(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _err(rec, f"has no block {blk.block_id}")
    _check_special(page, rec)
    _xid, ntodelete = _main(rec, _DELETE)
    if len(rec.main_data) > _DELETE.size:
        todelete = _offsets(rec.main_data, _DELETE.size, ntodelete, rec, "todelete")
        if _DELETE.size + 2 * ntodelete != len(rec.main_data):
            raise _err(rec, f"main data holds {len(rec.main_data) - _DELETE.size} offset bytes, not {ntodelete} offsets")
        bp.page_index_multi_delete(page, todelete)
    _set_flags(page, get_flags(page) & ~F_HAS_GARBAGE)


def _page_split(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    origrlink, orignsn, origleaf, npage, markfollowright = _main(rec, _PAGE_SPLIT)
    bid = blk.block_id
    if bid == 0:
        clear_follow_right(page, rec)
        return
    if not 1 <= bid <= npage:
        raise _err(rec, f"has no block {bid} (a split into {npage} pages)")
    first = rec.block(1)
    if first is None:
        raise _err(rec, "has no block 1")
    isrootsplit = first.blkno == GIST_ROOT_BLKNO
    data = blk.data
    if len(data) < _I32.size:
        raise _err(rec, f"block {bid} data holds no tuple count")
    (num,) = _I32.unpack_from(data, 0)
    tuples = _tuples(data, _I32.size, rec, f"block {bid} tuples")
    if len(tuples) != num:
        raise _err(rec, f"block {bid} holds {len(tuples)} tuples, its count says {num}")
    blkno = blk.blkno
    if blkno == GIST_ROOT_BLKNO and bid != 1:
        raise _err(rec, f"the root is block {bid} of the split, not the first")
    init_page(page, F_LEAF if origleaf and blkno != GIST_ROOT_BLKNO else 0)
    _add_tuples(page, tuples, 1, rec)
    flags = get_flags(page)
    if blkno == GIST_ROOT_BLKNO:
        rightlink = INVALID_BLOCK
        flags &= ~F_FOLLOW_RIGHT
    else:
        if bid < npage:
            nxt = rec.block(bid + 1)
            if nxt is None:
                raise _err(rec, f"has no block {bid + 1}, the right sibling of block {bid}")
            rightlink = nxt.blkno
        else:
            rightlink = origrlink
        if bid < npage and not isrootsplit and markfollowright:
            flags |= F_FOLLOW_RIGHT
        else:
            flags &= ~F_FOLLOW_RIGHT
    _OPAQUE.pack_into(page, _OPAQUE_POS, orignsn >> 32, orignsn & 0xFFFF_FFFF, rightlink, flags, GIST_PAGE_ID)


def _page_delete(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    delete_xid, downlink = _main(rec, _PAGE_DELETE)
    _check_special(page, rec)
    if blk.block_id == 0:
        # GistPageSetDeleted: the leaf is empty already
        if bp.max_offset(page) != 0:
            raise _err(rec, f"page to delete still holds {bp.max_offset(page)} tuples")
        _set_flags(page, get_flags(page) | F_DELETED)
        bp.set_lower(page, bp.SIZE_OF_PAGE_HEADER + _U64.size)
        _U64.pack_into(page, bp.SIZE_OF_PAGE_HEADER, delete_xid)
    elif blk.block_id == 1:
        bp.page_index_tuple_delete(page, downlink)
    else:
        raise _err(rec, f"has no block {blk.block_id}")


_ROUTINES = {
    XLOG_GIST_PAGE_UPDATE: _page_update,
    XLOG_GIST_DELETE: _delete,
    XLOG_GIST_PAGE_SPLIT: _page_split,
    XLOG_GIST_PAGE_DELETE: _page_delete,
}


def redo_gist(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    info = rec.xl_info & 0xF0
    routine = _ROUTINES.get(info)
    if routine is None:
        # PAGE_REUSE and ASSIGN_LSN register no block; anything else is not GiST WAL
        raise _err(rec, f"record type {info:#x} changes no page (block {blk.block_id})")
    routine(page, rec, blk)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_gist_on_image(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    """The change applied on top of a restored image: the left child's NSN and F_FOLLOW_RIGHT
    (PAGE_UPDATE block 1, PAGE_SPLIT block 0). Nothing for other blocks."""
    info = rec.xl_info & 0xF0
    if (info == XLOG_GIST_PAGE_UPDATE and blk.block_id == 1) or (info == XLOG_GIST_PAGE_SPLIT and blk.block_id == 0):
        clear_follow_right(page, rec)
        bp.page_set_lsn(page, rec.end_lsn)
