"""Hash index (rmid 12) redo on one page: PostgreSQL 15's ``hash_xlog.c``, block by block.

A hash record touches up to seven pages (a squeeze: primary bucket, write page, freed
overflow page, its neighbours, bitmap page, metapage). The manager calls ``redo_hash`` once
per requested page with that page's block reference and only the part for that block runs.
The parts read their own page, the main data, their own block data and, where PostgreSQL
does, *other blocks' numbers* (ADD_OVFL_PAGE links the new overflow page to the page
before it); never another block's page or data, so page-at-a-time replay is exact.

Two record types change a page on top of an applied full-page image (SPLIT_ALLOCATE_PAGE's
old bucket, SPLIT_COMPLETE's both buckets); the manager runs ``redo_hash_on_image`` after
restoring such an image. Blocks registered only so that recovery takes a cleanup lock on the
primary bucket (MOVE_PAGE_CONTENTS, SQUEEZE_PAGE and DELETE's block 0) are left as they are,
LSN included, as PostgreSQL leaves them.

Page layouts (``hash.h``): the 16-byte special area ``prev u32, next u32, bucket u32,
flag u16, page_id u16`` at 8176; the metapage's ``HashMetaPageData`` at 24; a bitmap page's
bit words at 24.
"""

from __future__ import annotations

import math
import struct

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_HASH_ADD_OVFL_PAGE,
    XLOG_HASH_DELETE,
    XLOG_HASH_INIT_BITMAP_PAGE,
    XLOG_HASH_INIT_META_PAGE,
    XLOG_HASH_INSERT,
    XLOG_HASH_MOVE_PAGE_CONTENTS,
    XLOG_HASH_SPLIT_ALLOCATE_PAGE,
    XLOG_HASH_SPLIT_CLEANUP,
    XLOG_HASH_SPLIT_COMPLETE,
    XLOG_HASH_SPLIT_PAGE,
    XLOG_HASH_SQUEEZE_PAGE,
    XLOG_HASH_UPDATE_META_PAGE,
    XLOG_HASH_VACUUM_ONE_PAGE,
    record_type_name,
)

# hasho_flag
LH_UNUSED_PAGE = 0
LH_OVERFLOW_PAGE = 1 << 0
LH_BUCKET_PAGE = 1 << 1
LH_BITMAP_PAGE = 1 << 2
LH_META_PAGE = 1 << 3
LH_BUCKET_BEING_POPULATED = 1 << 4
LH_BUCKET_BEING_SPLIT = 1 << 5
LH_BUCKET_NEEDS_SPLIT_CLEANUP = 1 << 6
LH_PAGE_HAS_DEAD_TUPLES = 1 << 7
LH_PAGE_TYPE = LH_OVERFLOW_PAGE | LH_BUCKET_PAGE | LH_BITMAP_PAGE | LH_META_PAGE

HASHO_PAGE_ID = 0xFF80
HASH_MAGIC = 0x6440640
HASH_VERSION = 4
INVALID_BLOCK = 0xFFFF_FFFF
SIZEOF_HASH_OPAQUE = 16
SPECIAL = bp.BLCKSZ - SIZEOF_HASH_OPAQUE  # 8176: where every hash page's special area is
HASH_MAX_SPLITPOINTS = 98
HASH_MAX_BITMAPS = 1024
SPLIT_META_UPDATE_MASKS = 0x01
SPLIT_META_UPDATE_SPLITPOINT = 0x02
INDEX_SIZE_MASK = 0x1FFF

_U16 = bp.U16
_U32 = bp.U32
_F64 = struct.Struct("<d")
_OPAQUE = struct.Struct("<IIIHH")  # prevblkno, nextblkno, bucket, flag, page_id
_OFF_PREV = SPECIAL
_OFF_NEXT = SPECIAL + 4
_OFF_FLAG = SPECIAL + 12

# HashMetaPageData at page offset 24 (hash.h), as page offsets
META = 24
M_MAGIC = META + 0
M_NTUPLES = META + 8
M_MAXBUCKET = META + 24
M_OVFLPOINT = META + 36
M_FIRSTFREE = META + 40
M_NMAPS = META + 44
M_SPARES = META + 52
M_MAPP = META + 444
SIZEOF_META = 4544  # sizeof(HashMetaPageData), trailing padding included
# magic, version, ntuples, ffactor, bsize, bmsize, bmshift, maxbucket, highmask, lowmask,
# ovflpoint, firstfree, nmaps, procid
_META_HEAD = struct.Struct("<IIdHHHHIIIIIII")
BITMAP = 24  # HashPageGetBitmap: PageGetContents

_XL_INIT_META = struct.Struct("<dIH")  # num_tuples, procid, ffactor
_XL_ADD_OVFL = struct.Struct("<HB")  # bmsize, bmpage_found
_XL_SPLIT_ALLOC = struct.Struct("<IHHB")  # new_bucket, old_bucket_flag, new_bucket_flag, flags
_XL_SPLIT_COMPLETE = struct.Struct("<HH")  # old_bucket_flag, new_bucket_flag
_XL_MOVE = struct.Struct("<HB")  # ntups, is_prim_bucket_same_wrt
_XL_SQUEEZE = struct.Struct("<IIHBB")  # prevblkno, nextblkno, ntups, prim_same_wrt, prev_same_wrt
_XL_DELETE = struct.Struct("<BB")  # clear_dead_marking, is_primary_bucket_page
_XL_VACUUM_ONE = struct.Struct("<Ii")  # latestRemovedXid, ntuples; offsets follow
_XL_MASKS = struct.Struct("<II")  # lowmask, highmask
_XL_SPLITPOINT = struct.Struct("<II")  # ovflpoint, spares value


def _err(rec: DecodedRecord, msg: str) -> RedoError:
    return RedoError(f"Hash/{record_type_name(rec.xl_rmid, rec.xl_info)}: {msg}", lsn=rec.end_lsn, rmgr="Hash")


def _check_hash_page(page: bytearray, rec: DecodedRecord) -> None:
    """The special area must be where every hash page has it before redo writes into it."""
    if bp.get_special(page) != SPECIAL or _U16.unpack_from(page, SPECIAL + 14)[0] != HASHO_PAGE_ID:
        raise _err(rec, f"not a hash page (pd_special {bp.get_special(page)})")


def _check_meta(page: bytearray, rec: DecodedRecord) -> None:
    _check_hash_page(page, rec)
    if _U32.unpack_from(page, M_MAGIC)[0] != HASH_MAGIC:
        raise _err(rec, "block is not a hash metapage")


def _u32_data(blk: BlockRef, rec: DecodedRecord, what: str) -> int:
    data = blk.data
    if len(data) < 4:
        raise _err(rec, f"block {blk.block_id} data holds no {what} ({len(data)} bytes)")
    v: int = _U32.unpack_from(data, 0)[0]
    return v


def _other_blkno(rec: DecodedRecord, block_id: int) -> int:
    other = rec.block(block_id)
    if other is None:
        raise _err(rec, f"block {block_id} is missing")
    return other.blkno


# --- page initializers (hashpage.c, hashovfl.c) ----------------------------------------------


def init_buf(page: bytearray, max_bucket: int, bucket: int, flag: int) -> None:
    """_hash_initbuf on a fresh page."""
    bp.page_init(page, SIZEOF_HASH_OPAQUE)
    _OPAQUE.pack_into(page, SPECIAL, max_bucket, INVALID_BLOCK, bucket, flag, HASHO_PAGE_ID)


def init_bitmap(page: bytearray, bmsize: int, rec: DecodedRecord) -> None:
    """_hash_initbitmapbuffer: every bit set (all overflow pages in use), pd_lower after them."""
    if bmsize == 0 or BITMAP + bmsize > SPECIAL:
        raise _err(rec, f"bitmap size {bmsize} does not fit a page")
    bp.page_init(page, SIZEOF_HASH_OPAQUE)
    _OPAQUE.pack_into(page, SPECIAL, INVALID_BLOCK, INVALID_BLOCK, INVALID_BLOCK, LH_BITMAP_PAGE, HASHO_PAGE_ID)
    page[BITMAP : BITMAP + bmsize] = b"\xff" * bmsize
    bp.set_lower(page, BITMAP + bmsize)


def _ceil_log2(n: int) -> int:
    return 0 if n < 2 else (n - 1).bit_length()


def spareindex(num_bucket: int) -> int:
    """_hash_spareindex: the split-point phase that allocates bucket ``num_bucket``."""
    group = _ceil_log2(num_bucket)
    if group < 10:
        return group
    return 10 + ((group - 10) << 2) + (((num_bucket - 1) >> (group - 3)) & 3)


def total_buckets(phase: int) -> int:
    """_hash_get_totalbuckets: how many buckets exist once split-point ``phase`` is done."""
    if phase < 10:
        return 1 << phase
    group = 10 + ((phase - 10) >> 2)
    half = 1 << (group - 1)
    return half + (half >> 2) * (((phase - 10) & 3) + 1)


def init_metapage(page: bytearray, num_tuples: float, procid: int, ffactor: int, rec: DecodedRecord) -> None:
    """_hash_init_metabuffer: the bucket count follows from the estimate and the fill factor."""
    if ffactor == 0 or math.isnan(num_tuples):
        raise _err(rec, f"fill factor {ffactor} / estimate {num_tuples} give no bucket count")
    d = num_tuples / ffactor
    if d <= 2.0:
        nbuckets = 2
    elif d >= float(0x4000_0000):
        nbuckets = 0x4000_0000
    else:
        nbuckets = total_buckets(spareindex(int(d)))
    spare = spareindex(nbuckets)
    bp.page_init(page, SIZEOF_HASH_OPAQUE)
    _OPAQUE.pack_into(page, SPECIAL, INVALID_BLOCK, INVALID_BLOCK, INVALID_BLOCK, LH_META_PAGE, HASHO_PAGE_ID)
    bsize = SPECIAL - bp.SIZE_OF_PAGE_HEADER  # HashGetMaxBitmapSize
    shift = bsize.bit_length() - 1  # the largest power of two that fits
    highmask = (1 << nbuckets.bit_length()) - 1  # pg_nextpower2_32(nbuckets + 1) - 1
    _META_HEAD.pack_into(
        page, META, HASH_MAGIC, HASH_VERSION, 0.0, ffactor, bsize, 1 << shift, shift + 3,
        nbuckets - 1, highmask, highmask >> 1, spare, 0, 0, procid,
    )
    _U32.pack_into(page, M_SPARES + 4 * spare, 1)
    bp.set_lower(page, META + SIZEOF_META)


# --- pieces shared by several records ------------------------------------------------------


def _set_flag(page: bytearray, flag: int) -> None:
    _U16.pack_into(page, _OFF_FLAG, flag)


def _clear_flag(page: bytearray, bit: int) -> None:
    _U16.pack_into(page, _OFF_FLAG, _U16.unpack_from(page, _OFF_FLAG)[0] & ~bit)


def _bitmap_word(page: bytearray, bit: int, rec: DecodedRecord) -> int:
    pos = BITMAP + (bit >> 5) * 4
    if pos + 4 > bp.get_lower(page) or bp.get_lower(page) > SPECIAL:
        raise _err(rec, f"bit {bit} is past the bitmap (pd_lower {bp.get_lower(page)})")
    return pos


def _add_tuple(page: bytearray, tup: bytes, offnum: int, rec: DecodedRecord) -> None:
    if bp.page_add_item(page, tup, offnum, overwrite=False, is_heap=False) == 0:
        raise _err(rec, f"failed to add a {len(tup)}-byte tuple at offset {offnum}")


def _add_moved_tuples(page: bytearray, data: bytes, ntups: int, rec: DecodedRecord) -> None:
    """MOVE_PAGE_CONTENTS / SQUEEZE_PAGE write page: ``ntups`` offsets, then the tuples, each
    added with its MAXALIGNed size at its offset."""
    if ntups == 0:
        return
    head = 2 * ntups
    if len(data) < head:
        raise _err(rec, f"{ntups} target offsets announced, {len(data)} bytes of data")
    towrite = struct.unpack_from(f"<{ntups}H", data, 0)
    pos = head
    end = len(data)
    n = 0
    while pos < end:
        if pos + 8 > end:
            raise _err(rec, "truncated index tuple")
        size = bp.maxalign(_U16.unpack_from(data, pos + 6)[0] & INDEX_SIZE_MASK)
        if size < 8 or pos + size > end:
            raise _err(rec, f"index tuple of {size} bytes at {pos} does not fit the {end}-byte data")
        if n >= ntups:
            raise _err(rec, f"more tuples than the {ntups} announced")
        _add_tuple(page, data[pos : pos + size], towrite[n], rec)
        pos += size
        n += 1
    if n != ntups:
        raise _err(rec, f"{n} tuples logged, {ntups} announced")


def _offsets(data: bytes, rec: DecodedRecord) -> tuple[int, ...]:
    if len(data) % 2:
        raise _err(rec, f"offset array of odd length {len(data)}")
    return struct.unpack_from(f"<{len(data) // 2}H", data, 0)


# --- records ------------------------------------------------------------------------------


def _init_meta_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _err(rec, f"no block {blk.block_id}")
    num_tuples, procid, ffactor = _XL_INIT_META.unpack_from(rec.main_data)
    init_metapage(page, num_tuples, procid, ffactor, rec)


def _init_bitmap_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id == 0:
        init_bitmap(page, _U16.unpack_from(rec.main_data)[0], rec)
    elif blk.block_id == 1:
        _check_meta(page, rec)
        nmaps = _U32.unpack_from(page, M_NMAPS)[0]
        if nmaps >= HASH_MAX_BITMAPS:
            raise _err(rec, f"metapage already has {nmaps} bitmap pages")
        maxbucket = _U32.unpack_from(page, M_MAXBUCKET)[0]
        _U32.pack_into(page, M_MAPP + 4 * nmaps, (maxbucket + 2) & 0xFFFF_FFFF)
        _U32.pack_into(page, M_NMAPS, nmaps + 1)
    else:
        raise _err(rec, f"no block {blk.block_id}")


def _insert(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id == 0:
        (offnum,) = _U16.unpack_from(rec.main_data)
        data = blk.data
        if len(data) < 8 or _U16.unpack_from(data, 6)[0] & INDEX_SIZE_MASK != len(data):
            raise _err(rec, f"block data of {len(data)} bytes is not one index tuple")
        _check_hash_page(page, rec)
        _add_tuple(page, data, offnum, rec)
    elif blk.block_id == 1:
        _check_meta(page, rec)
        _F64.pack_into(page, M_NTUPLES, _F64.unpack_from(page, M_NTUPLES)[0] + 1)
    else:
        raise _err(rec, f"no block {blk.block_id}")


def _add_ovfl_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    bmsize, bmpage_found = _XL_ADD_OVFL.unpack_from(rec.main_data)
    bid = blk.block_id
    if bid == 0:
        bucket = _u32_data(blk, rec, "bucket number")
        init_buf(page, INVALID_BLOCK, bucket, LH_OVERFLOW_PAGE)
        _U32.pack_into(page, _OFF_PREV, _other_blkno(rec, 1))
    elif bid == 1:
        _check_hash_page(page, rec)
        _U32.pack_into(page, _OFF_NEXT, _other_blkno(rec, 0))
    elif bid == 2:
        bit = _u32_data(blk, rec, "bitmap bit")
        _check_hash_page(page, rec)
        pos = _bitmap_word(page, bit, rec)
        _U32.pack_into(page, pos, _U32.unpack_from(page, pos)[0] | (1 << (bit & 31)))
    elif bid == 3:
        init_bitmap(page, bmsize, rec)
    elif bid == 4:
        firstfree = _u32_data(blk, rec, "first free bit")
        _check_meta(page, rec)
        _U32.pack_into(page, M_FIRSTFREE, firstfree)
        if not bmpage_found:
            ovflpoint = _U32.unpack_from(page, M_OVFLPOINT)[0]
            if ovflpoint >= HASH_MAX_SPLITPOINTS:
                raise _err(rec, f"metapage split point {ovflpoint} out of range")
            spos = M_SPARES + 4 * ovflpoint
            spares = _U32.unpack_from(page, spos)[0] + 1
            newmap = rec.block(3)
            if newmap is not None:
                nmaps = _U32.unpack_from(page, M_NMAPS)[0]
                if nmaps >= HASH_MAX_BITMAPS:
                    raise _err(rec, f"metapage already has {nmaps} bitmap pages")
                _U32.pack_into(page, M_MAPP + 4 * nmaps, newmap.blkno)
                _U32.pack_into(page, M_NMAPS, nmaps + 1)
                spares += 1
            _U32.pack_into(page, spos, spares & 0xFFFF_FFFF)
    else:
        raise _err(rec, f"no block {bid}")


def _split_allocate_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    new_bucket, old_flag, new_flag, flags = _XL_SPLIT_ALLOC.unpack_from(rec.main_data)
    bid = blk.block_id
    if bid == 0:
        _check_hash_page(page, rec)
        _set_flag(page, old_flag)
        _U32.pack_into(page, _OFF_PREV, new_bucket)
    elif bid == 1:
        init_buf(page, new_bucket, new_bucket, new_flag)
    elif bid == 2:
        _check_meta(page, rec)
        _U32.pack_into(page, M_MAXBUCKET, new_bucket)
        data = blk.data
        pos = 0
        if flags & SPLIT_META_UPDATE_MASKS:
            lowmask, highmask = _XL_MASKS.unpack_from(data, pos)
            _U32.pack_into(page, META + 32, lowmask)
            _U32.pack_into(page, META + 28, highmask)
            pos += _XL_MASKS.size
        if flags & SPLIT_META_UPDATE_SPLITPOINT:
            ovflpoint, spares = _XL_SPLITPOINT.unpack_from(data, pos)
            if ovflpoint >= HASH_MAX_SPLITPOINTS:
                raise _err(rec, f"split point {ovflpoint} out of range")
            _U32.pack_into(page, M_SPARES + 4 * ovflpoint, spares)
            _U32.pack_into(page, M_OVFLPOINT, ovflpoint)
    else:
        raise _err(rec, f"no block {bid}")


def _split_complete(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    old_flag, new_flag = _XL_SPLIT_COMPLETE.unpack_from(rec.main_data)
    if blk.block_id > 1:
        raise _err(rec, f"no block {blk.block_id}")
    _check_hash_page(page, rec)
    _set_flag(page, old_flag if blk.block_id == 0 else new_flag)


def _move_page_contents(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    ntups, _prim_same = _XL_MOVE.unpack_from(rec.main_data)
    bid = blk.block_id
    if bid == 1:
        _check_hash_page(page, rec)
        _add_moved_tuples(page, blk.data, ntups, rec)
    elif bid == 2:
        _check_hash_page(page, rec)
        offs = _offsets(blk.data, rec)
        if offs:
            bp.page_index_multi_delete(page, offs)
    else:
        raise _err(rec, f"no block {bid}")


def _squeeze_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    prevblkno, nextblkno, ntups, _prim_same, prev_same = _XL_SQUEEZE.unpack_from(rec.main_data)
    bid = blk.block_id
    if bid == 1:
        _check_hash_page(page, rec)
        _add_moved_tuples(page, blk.data, ntups, rec)
        if prev_same:
            _U32.pack_into(page, _OFF_NEXT, nextblkno)
    elif bid == 2:
        # the freed overflow page: an empty LH_UNUSED page (not WILL_INIT: redo rewrites it)
        bp.page_init(page, SIZEOF_HASH_OPAQUE)
        _OPAQUE.pack_into(page, SPECIAL, INVALID_BLOCK, INVALID_BLOCK, INVALID_BLOCK, LH_UNUSED_PAGE, HASHO_PAGE_ID)
    elif bid == 3:
        _check_hash_page(page, rec)
        _U32.pack_into(page, _OFF_NEXT, nextblkno)
    elif bid == 4:
        _check_hash_page(page, rec)
        _U32.pack_into(page, _OFF_PREV, prevblkno)
    elif bid == 5:
        bit = _u32_data(blk, rec, "bitmap bit")
        _check_hash_page(page, rec)
        pos = _bitmap_word(page, bit, rec)
        _U32.pack_into(page, pos, _U32.unpack_from(page, pos)[0] & ~(1 << (bit & 31)))
    elif bid == 6:
        firstfree = _u32_data(blk, rec, "first free bit")
        _check_meta(page, rec)
        _U32.pack_into(page, M_FIRSTFREE, firstfree)
    else:
        raise _err(rec, f"no block {bid}")


def _delete(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    clear_dead, _is_primary = _XL_DELETE.unpack_from(rec.main_data)
    if blk.block_id != 1:
        raise _err(rec, f"no block {blk.block_id}")
    _check_hash_page(page, rec)
    offs = _offsets(blk.data, rec)
    if offs:
        bp.page_index_multi_delete(page, offs)
    if clear_dead:
        _clear_flag(page, LH_PAGE_HAS_DEAD_TUPLES)


def _split_cleanup(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _err(rec, f"no block {blk.block_id}")
    _check_hash_page(page, rec)
    _clear_flag(page, LH_BUCKET_NEEDS_SPLIT_CLEANUP)


def _update_meta_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _err(rec, f"no block {blk.block_id}")
    (ntuples,) = _F64.unpack_from(rec.main_data)
    _check_meta(page, rec)
    _F64.pack_into(page, M_NTUPLES, ntuples)


def _vacuum_one_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    main = rec.main_data
    _xid, ntuples = _XL_VACUUM_ONE.unpack_from(main)
    if blk.block_id == 0:
        _check_hash_page(page, rec)
        if len(main) > _XL_VACUUM_ONE.size:
            if ntuples < 0 or len(main) < _XL_VACUUM_ONE.size + 2 * ntuples:
                raise _err(rec, f"{ntuples} offsets announced, {len(main) - _XL_VACUUM_ONE.size} bytes follow")
            offs = struct.unpack_from(f"<{ntuples}H", main, _XL_VACUUM_ONE.size)
            if offs:
                bp.page_index_multi_delete(page, offs)
        _clear_flag(page, LH_PAGE_HAS_DEAD_TUPLES)
    elif blk.block_id == 1:
        _check_meta(page, rec)
        _F64.pack_into(page, M_NTUPLES, _F64.unpack_from(page, M_NTUPLES)[0] - ntuples)
    else:
        raise _err(rec, f"no block {blk.block_id}")


def _split_page(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    raise _err(rec, f"block {blk.block_id} carries no full-page image to restore")


_ROUTINES = {
    XLOG_HASH_INIT_META_PAGE: _init_meta_page,
    XLOG_HASH_INIT_BITMAP_PAGE: _init_bitmap_page,
    XLOG_HASH_INSERT: _insert,
    XLOG_HASH_ADD_OVFL_PAGE: _add_ovfl_page,
    XLOG_HASH_SPLIT_ALLOCATE_PAGE: _split_allocate_page,
    XLOG_HASH_SPLIT_PAGE: _split_page,
    XLOG_HASH_SPLIT_COMPLETE: _split_complete,
    XLOG_HASH_MOVE_PAGE_CONTENTS: _move_page_contents,
    XLOG_HASH_SQUEEZE_PAGE: _squeeze_page,
    XLOG_HASH_DELETE: _delete,
    XLOG_HASH_SPLIT_CLEANUP: _split_cleanup,
    XLOG_HASH_UPDATE_META_PAGE: _update_meta_page,
    XLOG_HASH_VACUUM_ONE_PAGE: _vacuum_one_page,
}

# (record type, block id) pairs registered only for a cleanup lock: page and LSN unchanged
_LOCK_ONLY = frozenset(
    {(XLOG_HASH_MOVE_PAGE_CONTENTS, 0), (XLOG_HASH_SQUEEZE_PAGE, 0), (XLOG_HASH_DELETE, 0)}
)


def redo_hash(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    info = rec.xl_info & 0xF0
    if (info, blk.block_id) in _LOCK_ONLY:
        return
    routine = _ROUTINES.get(info)
    if routine is None:
        raise _err(rec, "unknown record type")
    routine(page, rec, blk)
    bp.page_set_lsn(page, rec.end_lsn)


def redo_hash_on_image(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    """The changes PostgreSQL applies on top of a restored image (BLK_RESTORED is redone too)."""
    info = rec.xl_info & 0xF0
    if not (
        (info == XLOG_HASH_SPLIT_ALLOCATE_PAGE and blk.block_id == 0)
        or (info == XLOG_HASH_SPLIT_COMPLETE and blk.block_id in (0, 1))
    ):
        return
    try:
        if info == XLOG_HASH_SPLIT_ALLOCATE_PAGE:
            _split_allocate_page(page, rec, blk)
        else:
            _split_complete(page, rec, blk)
    except struct.error as exc:
        raise _err(rec, f"malformed record ({exc})") from None
    bp.page_set_lsn(page, rec.end_lsn)
