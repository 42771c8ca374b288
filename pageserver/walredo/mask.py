"""PostgreSQL's page masking (``access/common/bufmask.c`` and each rmgr's ``rm_mask``).

wal_consistency_checking compares a replayed page with the primary's image only after both
went through the record's resource manager mask: fields that change without WAL (hint bits,
LSN, checksum, free space, btree LP_DEAD flags...) are set to a fixed value. These functions
mask a copy; the page passed in is never modified.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from pageserver.walredo import bufpage as bp
from pageserver.walredo.brin import brin_mask
from pageserver.walredo.btree import BTP_HAS_GARBAGE, BTP_LEAF, BTP_SPLIT_END
from pageserver.walredo.errors import RedoError
from pageserver.walredo.gin import gin_mask
from pageserver.walredo.gist import F_FOLLOW_RIGHT as GIST_F_FOLLOW_RIGHT
from pageserver.walredo.gist import F_HAS_GARBAGE as GIST_F_HAS_GARBAGE
from pageserver.walredo.gist import F_LEAF as GIST_F_LEAF
from pageserver.walredo.gist import F_TUPLES_DELETED as GIST_F_TUPLES_DELETED
from pageserver.walredo.hash import (
    LH_BUCKET_PAGE,
    LH_OVERFLOW_PAGE,
    LH_PAGE_HAS_DEAD_TUPLES,
    LH_PAGE_TYPE,
    LH_UNUSED_PAGE,
)
from pageserver.walredo.heap import (
    HEAP_XACT_MASK,
    HEAP_XMAX_COMMITTED,
    HEAP_XMAX_INVALID,
    HEAP_XMIN_FROZEN,
    SPEC_TOKEN_OFFSET,
)
from protocol.wal.rmgr import RmgrId

MASK_MARKER = 0


def mask_page_lsn_and_checksum(page: bytearray) -> None:
    page[0:10] = bytes(10)


def mask_page_hint_bits(page: bytearray) -> None:
    bp.set_prune_xid(page, MASK_MARKER)
    flags = bp.get_flags(page)
    bp.set_flags(page, flags & ~(bp.PD_PAGE_FULL | bp.PD_HAS_FREE_LINES | bp.PD_ALL_VISIBLE))


def mask_unused_space(page: bytearray) -> None:
    lower, upper, special = bp.LOWER_UPPER_SPECIAL.unpack_from(page, bp.OFF_LOWER)
    if lower > upper or special < upper or lower < bp.SIZE_OF_PAGE_HEADER or special > bp.BLCKSZ:
        raise RedoError(f"invalid page pd_lower {lower} pd_upper {upper} pd_special {special}")
    page[lower:upper] = bytes(upper - lower)


def mask_lp_flags(page: bytearray) -> None:
    """Every used line pointer's lp_flags set to LP_UNUSED: the 2 flag bits (15, 16) of each
    32-bit pointer cleared in one AND over the array as one integer (an unused pointer's flags
    are 0 already), not in a loop over hundreds of pointers: validation masks both the
    replayed page and the image of every record."""
    n = bp.max_offset(page)
    if n <= 0:
        return
    start = bp.SIZE_OF_PAGE_HEADER
    end = start + bp.ITEM_ID_SIZE * n
    if end > len(page):
        raise RedoError(f"invalid page pd_lower {bp.get_lower(page)}: line pointers past the page")
    x = int.from_bytes(page[start:end], "little")
    page[start:end] = (x & ~_flag_lanes(n)).to_bytes(end - start, "little")


_FLAG_LANES: dict[int, int] = {}


def _flag_lanes(n: int) -> int:
    """Bits 15 and 16 (lp_flags) set in each of ``n`` 32-bit lanes."""
    lanes = _FLAG_LANES.get(n)
    if lanes is None:
        lanes = _FLAG_LANES[n] = int.from_bytes(b"\x00\x80\x01\x00" * n, "little")
    return lanes


def mask_page_content(page: bytearray) -> None:
    page[bp.SIZE_OF_PAGE_HEADER :] = bytes(bp.BLCKSZ - bp.SIZE_OF_PAGE_HEADER)
    bp.set_lower(page, MASK_MARKER)
    bp.set_upper(page, MASK_MARKER)


def heap_mask(page: bytearray, blkno: int) -> None:
    mask_page_lsn_and_checksum(page)
    mask_page_hint_bits(page)
    mask_unused_space(page)
    u16 = bp.U16
    nline = bp.max_offset(page)
    # mask_unused_space checked pd_lower: the pointer array is inside the page
    for off, raw in enumerate(struct.unpack_from(f"<{nline}I", page, bp.SIZE_OF_PAGE_HEADER), 1):
        item = raw & 0x7FFF
        length = raw >> 17
        if (raw >> 15) & 3 == bp.LP_NORMAL:
            (infomask,) = u16.unpack_from(page, item + 20)
            if infomask & HEAP_XMIN_FROZEN != HEAP_XMIN_FROZEN:
                infomask &= ~HEAP_XACT_MASK
            else:
                infomask &= ~(HEAP_XMAX_INVALID | HEAP_XMAX_COMMITTED)
            u16.pack_into(page, item + 20, infomask)
            bp.U32.pack_into(page, item + 8, MASK_MARKER)
            if u16.unpack_from(page, item + 16)[0] == SPEC_TOKEN_OFFSET:
                bp.U16.pack_into(page, item + 12, blkno >> 16)
                bp.U16.pack_into(page, item + 14, blkno & 0xFFFF)
                bp.U16.pack_into(page, item + 16, off)
        if length:
            pad = bp.maxalign(length) - length
            if pad:
                page[item + length : item + length + pad] = bytes(pad)


def btree_mask(page: bytearray, blkno: int) -> None:
    mask_page_lsn_and_checksum(page)
    mask_page_hint_bits(page)
    mask_unused_space(page)
    special = bp.get_special(page)
    flags_pos = special + 12  # after btpo_prev, btpo_next, btpo_level
    (flags,) = bp.U16.unpack_from(page, flags_pos)
    if flags & BTP_LEAF:
        mask_lp_flags(page)
    bp.U16.pack_into(page, flags_pos, flags & ~(BTP_HAS_GARBAGE | BTP_SPLIT_END))
    bp.U16.pack_into(page, flags_pos + 2, 0)


def hash_mask(page: bytearray, blkno: int) -> None:
    mask_page_lsn_and_checksum(page)
    mask_page_hint_bits(page)
    mask_unused_space(page)
    flag_pos = bp.get_special(page) + 12  # after hasho_prevblkno, hasho_nextblkno, hasho_bucket
    (flag,) = bp.U16.unpack_from(page, flag_pos)
    pagetype = flag & LH_PAGE_TYPE
    if pagetype == LH_UNUSED_PAGE:
        mask_page_content(page)
    elif pagetype in (LH_BUCKET_PAGE, LH_OVERFLOW_PAGE):
        mask_lp_flags(page)  # scans set LP_DEAD without WAL
    bp.U16.pack_into(page, flag_pos, flag & ~LH_PAGE_HAS_DEAD_TUPLES)


def generic_mask(page: bytearray, blkno: int) -> None:
    """No hint-bit masking: an extension's pd_flags and pd_prune_xid are compared as logged."""
    mask_page_lsn_and_checksum(page)
    mask_unused_space(page)


def seq_mask(page: bytearray, blkno: int) -> None:
    mask_page_lsn_and_checksum(page)
    mask_unused_space(page)


def gist_mask(page: bytearray, blkno: int) -> None:
    """gist_mask, plus F_TUPLES_DELETED, which 15.x minor releases set differently and nothing
    reads (``gist.py``)."""
    mask_page_lsn_and_checksum(page)
    mask_page_hint_bits(page)
    mask_unused_space(page)
    special = bp.get_special(page)
    bp.LSN_HALVES.pack_into(page, special, MASK_MARKER, MASK_MARKER)  # the NSN is an LSN
    flags_pos = special + 12
    flags = bp.U16.unpack_from(page, flags_pos)[0]
    if flags & GIST_F_LEAF:
        mask_lp_flags(page)  # LP_DEAD is set by scans without WAL (gistkillitems)
    # F_FOLLOW_RIGHT changes after the record is written; redo never sets F_HAS_GARBAGE
    flags = (flags | GIST_F_FOLLOW_RIGHT) & ~(GIST_F_HAS_GARBAGE | GIST_F_TUPLES_DELETED)
    bp.U16.pack_into(page, flags_pos, flags)


def spg_mask(page: bytearray, blkno: int) -> None:
    """spg_mask: LSN/checksum, hint bits, and the hole if pd_lower looks set."""
    mask_page_lsn_and_checksum(page)
    mask_page_hint_bits(page)
    if bp.get_lower(page) >= bp.SIZE_OF_PAGE_HEADER:
        mask_unused_space(page)


def no_mask(page: bytearray, blkno: int) -> None:
    """Resource managers without rm_mask (XLOG): images are compared as they are."""


def fsm_vm_mask(page: bytearray, blkno: int) -> None:
    """Not a PostgreSQL mask: LSN and checksum only, for VM pages compared by tests."""
    mask_page_lsn_and_checksum(page)


MaskFn = Callable[[bytearray, int], None]

# rmid -> rm_mask
RM_MASKS: dict[int, MaskFn] = {
    RmgrId.XLOG: no_mask,
    RmgrId.HEAP2: heap_mask,
    RmgrId.HEAP: heap_mask,
    RmgrId.BTREE: btree_mask,
    RmgrId.SEQ: seq_mask,
    RmgrId.SPGIST: spg_mask,
    RmgrId.HASH: hash_mask,
    RmgrId.GENERIC: generic_mask,
    RmgrId.GIN: gin_mask,
    RmgrId.GIST: gist_mask,
    RmgrId.BRIN: brin_mask,
}


def masked(page: bytes | bytearray, blkno: int, mask: MaskFn) -> bytes:
    copy = bytearray(page)
    mask(copy, blkno)
    return bytes(copy)
