"""SP-GiST (rmid 16) redo on one page: PostgreSQL 15's ``spgxlog.c``, block by block.

Every SP-GiST record keeps its whole payload in the main data (offsets arrays, then the
unaligned tuples); block references carry no data. A record touches up to four pages (a
picksplit: source leaf, destination leaf, inner page, parent); the manager calls
``redo_spgist`` once per requested page and only that block's part of PostgreSQL's routine
runs here. The parts read other blocks only for their *numbers* (the target of a redirect or
of a parent downlink), which the record's block tags carry, so page-at-a-time replay is exact.

Tuples (``spgist_private.h``): the first 32-bit word holds ``tupstate`` in its low two bits
(LIVE 0, REDIRECT 1, DEAD 2, PLACEHOLDER 3). Leaf and dead tuples keep their size in the
upper 30 bits and ``nextOffset`` in the low 14 bits of the u16 at 4; inner tuples keep
``nNodes`` (bits 3-15) and ``prefixSize`` (bits 16-31) in the word and their size in the u16
at 4, with node tuples (IndexTupleData, downlink in t_tid) after an 8-byte header and the
prefix. Dead tuples are 16 bytes: pointer at 6, xid at 12.
"""

from __future__ import annotations

import struct

from pageserver.walredo import _spgist_select as kernel
from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_SPGIST_ADD_LEAF,
    XLOG_SPGIST_ADD_NODE,
    XLOG_SPGIST_MOVE_LEAFS,
    XLOG_SPGIST_PICKSPLIT,
    XLOG_SPGIST_SPLIT_TUPLE,
    XLOG_SPGIST_VACUUM_LEAF,
    XLOG_SPGIST_VACUUM_REDIRECT,
    XLOG_SPGIST_VACUUM_ROOT,
    RmgrId,
    record_type_name,
)

# page flags (SpGistPageOpaqueData.flags)
SPGIST_META = 1 << 0
SPGIST_DELETED = 1 << 1
SPGIST_LEAF = 1 << 2
SPGIST_NULLS = 1 << 3
SPGIST_PAGE_ID = 0xFF82
SIZEOF_SPGIST_OPAQUE = 8

# tuple states
SPGIST_LIVE = 0
SPGIST_REDIRECT = 1
SPGIST_DEAD = 2
SPGIST_PLACEHOLDER = 3

SGDTSIZE = 16  # MAXALIGN(sizeof(SpGistDeadTupleData))
SGITHDRSZ = 8  # MAXALIGN(sizeof(SpGistInnerTupleData))
SGLT_OFFSET_MASK = 0x3FFF
INVALID_BLOCK = 0xFFFF_FFFF

_U16 = bp.U16
_U32 = bp.U32
# flags, nRedirection, nPlaceholder, spgist_page_id
_OPAQUE = struct.Struct("<HHHH")
# word0 (tupstate | size << 2), t_info, pointer (bi_hi, bi_lo, posid), xid
_DEAD = struct.Struct("<IHHHHI")
_TID = struct.Struct("<HHH")

# Main data of each record, as PostgreSQL lays the C structs out (x86-64); spgxlogState is
# myXid u32 + isBuild bool, padded to 8, and always 4-aligned inside the record.
_ADD_LEAF = struct.Struct("<BBHHHH")  # newPage, storesNulls, offnumLeaf, offnumHeadLeaf, offnumParent, nodeI
_MOVE_LEAFS = struct.Struct("<HBBBxHHxxIB3x")  # nMoves, newPage, replaceDead, storesNulls, offnumParent, nodeI, state
_ADD_NODE = struct.Struct("<HHBbHHxxIB3x")  # offnum, offnumNew, newPage, parentBlk, offnumParent, nodeI, state
_SPLIT_TUPLE = struct.Struct("<HHBB")  # offnumPrefix, offnumPostfix, newPage, postfixBlkSame
# isRootSplit, nDelete, nInsert, initSrc, initDest, offnumInner, initInner, storesNulls,
# innerIsParent, offnumParent, nodeI, state
_PICKSPLIT = struct.Struct("<BxHHBBHBBBxHHxxIB3x")
_VACUUM_LEAF = struct.Struct("<HHHHIB3x")  # nDead, nPlaceholder, nMove, nChain, state
_VACUUM_ROOT = struct.Struct("<HxxIB3x")  # nDelete, state
_VACUUM_REDIRECT = struct.Struct("<HHI")  # nToPlaceholder, firstPlaceholder, newestRedirectXid

_LEAF_HDR = 16  # SGLTHDRSZ: word0, t_info, heapPtr, padded to 8
_INNER_MIN = SGITHDRSZ


def _name(rec: DecodedRecord) -> str:
    return f"SPGist/{record_type_name(RmgrId.SPGIST, rec.xl_info)}"


def _err(rec: DecodedRecord, msg: str) -> RedoError:
    return RedoError(f"{_name(rec)}: {msg}", lsn=rec.end_lsn, rmgr="SPGist")


# --- record payload ---------------------------------------------------------------------


class _Reader:
    """Walks the main data: fixed struct, u16 arrays, then unaligned tuples; every read is
    bounds-checked so a truncated record is an error, never a short read."""

    __slots__ = ("data", "pos", "rec")

    def __init__(self, rec: DecodedRecord) -> None:
        self.rec = rec
        self.data = rec.main_data
        self.pos = 0

    def fixed(self, st: struct.Struct) -> tuple[int, ...]:
        if len(self.data) < st.size:
            raise _err(self.rec, f"main data is {len(self.data)} bytes, the fixed part needs {st.size}")
        self.pos = st.size
        v: tuple[int, ...] = st.unpack_from(self.data, 0)
        return v

    def offsets(self, n: int, what: str) -> tuple[int, ...]:
        end = self.pos + 2 * n
        if end > len(self.data):
            raise _err(self.rec, f"{what}: {n} offsets do not fit in the main data")
        v: tuple[int, ...] = struct.unpack_from(f"<{n}H", self.data, self.pos)
        self.pos = end
        return v

    def bytes_(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise _err(self.rec, f"{what}: {n} bytes do not fit in the main data")
        v = bytes(self.data[self.pos : end])
        self.pos = end
        return v

    def finish(self) -> None:
        """The record must end where its last tuple ends (a longer one is garbled)."""
        if self.pos != len(self.data):
            raise _err(self.rec, f"main data has {len(self.data) - self.pos} bytes after its last tuple")

    def leaf_tuple(self, what: str) -> bytes:
        if self.pos + _LEAF_HDR > len(self.data):
            raise _err(self.rec, f"{what}: truncated leaf tuple header")
        size = _U32.unpack_from(self.data, self.pos)[0] >> 2
        if size < _LEAF_HDR:
            raise _err(self.rec, f"{what}: leaf tuple size {size} is below its header size")
        return self.bytes_(size, what)

    def skip(self, n: int, what: str) -> int:
        """Step over ``n`` bytes (an array the kernel reads in place); returns where they start."""
        if n > len(self.data) - self.pos:
            raise _err(self.rec, f"{what}: {n} bytes do not fit in the main data")
        at = self.pos
        self.pos += n
        return at

    def finish_at(self, end: int) -> None:
        """``finish`` after the kernel parsed the tuples up to ``end``."""
        self.pos = end
        self.finish()

    def inner_tuple(self, what: str) -> bytes:
        if self.pos + _INNER_MIN > len(self.data):
            raise _err(self.rec, f"{what}: truncated inner tuple header")
        size = _U16.unpack_from(self.data, self.pos + 4)[0]
        if size < _INNER_MIN:
            raise _err(self.rec, f"{what}: inner tuple size {size} is below its header size")
        return self.bytes_(size, what)


# --- page helpers -----------------------------------------------------------------------


def init_page(page: bytearray, flags: int) -> None:
    """SpGistInitPage: PageInit with an 8-byte special area, the flags and the page id."""
    bp.page_init(page, SIZEOF_SPGIST_OPAQUE)
    _OPAQUE.pack_into(page, bp.BLCKSZ - SIZEOF_SPGIST_OPAQUE, flags, 0, 0, SPGIST_PAGE_ID)


def _opaque_pos(page: bytearray, rec: DecodedRecord) -> int:
    special = bp.get_special(page)
    if special != bp.BLCKSZ - SIZEOF_SPGIST_OPAQUE:
        raise _err(rec, f"page special area at {special} is not an SP-GiST one")
    return special


def _add_counter(page: bytearray, rec: DecodedRecord, field: int, delta: int, what: str) -> None:
    """nRedirection (field 1) or nPlaceholder (field 2) += delta; never below 0."""
    pos = _opaque_pos(page, rec) + 2 * field
    v = _U16.unpack_from(page, pos)[0] + delta
    if v < 0 or v > 0xFFFF:
        raise _err(rec, f"{what} count would become {v}")
    _U16.pack_into(page, pos, v)


def _add_at(page: bytearray, tup: bytes, off: int, rec: DecodedRecord, what: str) -> None:
    if off == bp.max_offset(page) + 1 and off > 0:
        if not bp.page_append_items(page, (tup,)):
            raise _err(rec, f"failed to add {what} of size {len(tup)} at offset {off}")
        return
    if off == 0 or bp.page_add_item(page, tup, off, overwrite=False, is_heap=False) != off:
        raise _err(rec, f"failed to add {what} of size {len(tup)} at offset {off}")


def _item_pos(page: bytearray, off: int, rec: DecodedRecord) -> tuple[int, int]:
    """(offset, length) of the item at ``off``, checked to lie inside the page."""
    if off < 1 or off > bp.max_offset(page):
        raise _err(rec, f"offset {off} is not on the page (max {bp.max_offset(page)})")
    itemid = bp.get_itemid(page, off)
    pos = bp.lp_off(itemid)
    length = bp.lp_len(itemid)
    if length < 8 or pos < bp.SIZE_OF_PAGE_HEADER or pos + length > bp.get_special(page):
        raise _err(rec, f"line pointer {off} ({pos}, {length}) is corrupt")
    return pos, length


def add_or_replace(page: bytearray, tup: bytes, off: int, rec: DecodedRecord) -> None:
    """addOrReplaceTuple: add at ``off``; a tuple already there must be a placeholder."""
    if off <= bp.max_offset(page):
        pos, _ = _item_pos(page, off, rec)
        if page[pos] & 3 != SPGIST_PLACEHOLDER:
            raise _err(rec, f"tuple to be replaced at offset {off} is not a placeholder")
        _add_counter(page, rec, 2, -1, "placeholder")
        # PageIndexTupleDelete + PageAddItem at the same offset, in one pass
        if not bp.page_index_tuple_replace(page, off, tup):
            raise _err(rec, f"failed to add tuple of size {len(tup)} at offset {off}")
        return
    _add_at(page, tup, off, rec, "tuple")


def form_dead(state: int, blkno: int, offnum: int, xid: int) -> bytes:
    """spgFormDeadTuple: a REDIRECT points at (blkno, offnum) and keeps the xid."""
    word0 = state | (SGDTSIZE << 2)
    if state == SPGIST_REDIRECT:
        return _DEAD.pack(word0, 0, blkno >> 16, blkno & 0xFFFF, offnum, xid)
    return _DEAD.pack(word0, 0, 0xFFFF, 0xFFFF, 0, 0)


def multi_delete(
    page: bytearray, rec: DecodedRecord, at: int, n: int, first_state: int, rest_state: int, blkno: int, offnum: int,
    xid: int,
) -> None:
    """spgPageIndexMultiDelete of the ``n`` offsets at ``at`` in the main data: the tuples
    deleted and dead tuples put at the same offsets; the one named first in the (unsorted)
    array gets ``first_state``, the others ``rest_state`` (the kernel, one call)."""
    kernel.multi_delete(page, rec.main_data, at, n, first_state, rest_state, blkno, offnum, xid)


def update_node_link(page: bytearray, off: int, node_i: int, blkno: int, offnum: int, rec: DecodedRecord) -> None:
    """spgUpdateNodeLink: set the downlink of node ``node_i`` of the inner tuple at ``off``."""
    pos, length = _item_pos(page, off, rec)
    word0 = _U32.unpack_from(page, pos)[0]
    if word0 & 3 != SPGIST_LIVE:
        raise _err(rec, f"parent tuple at offset {off} is not a live inner tuple")
    nnodes = (word0 >> 3) & 0x1FFF
    size = _U16.unpack_from(page, pos + 4)[0]
    end = pos + min(size, length)
    p = pos + SGITHDRSZ + (word0 >> 16)
    for i in range(nnodes):
        if p + 8 > end:
            break
        if i == node_i:
            _TID.pack_into(page, p, blkno >> 16, blkno & 0xFFFF, offnum)
            return
        nsize = _U16.unpack_from(page, p + 6)[0] & 0x1FFF
        if nsize < 8:
            break
        p += nsize
    raise _err(rec, f"failed to find node {node_i} in the inner tuple at offset {off}")


def set_next_offset(page: bytearray, off: int, nxt: int, rec: DecodedRecord) -> None:
    """SGLT_SET_NEXTOFFSET on the leaf tuple at ``off`` (the top two t_info bits stay)."""
    pos, _ = _item_pos(page, off, rec)
    t_info = _U16.unpack_from(page, pos + 4)[0]
    _U16.pack_into(page, pos + 4, (t_info & ~SGLT_OFFSET_MASK) | (nxt & SGLT_OFFSET_MASK))


def _other_blkno(rec: DecodedRecord, block_id: int) -> int:
    b = rec.block(block_id)
    if b is None:
        raise _err(rec, f"the record has no block {block_id}, whose number this page needs")
    return b.blkno


def _leaf_flags(stores_nulls: int) -> int:
    return SPGIST_LEAF | (SPGIST_NULLS if stores_nulls else 0)


def _no_block(rec: DecodedRecord, blk: BlockRef) -> RedoError:
    return _err(rec, f"has no block {blk.block_id}")


# --- records ----------------------------------------------------------------------------


def _add_leaf(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    r = _Reader(rec)
    new_page, stores_nulls, off_leaf, off_head, off_parent, node_i = r.fixed(_ADD_LEAF)
    if blk.block_id == 0 and off_leaf != off_head:
        if new_page:
            init_page(page, _leaf_flags(stores_nulls))
        # addOrReplaceTuple of the leaf (after the fixed part) at offnumLeaf (the u16 at 2)
        r.finish_at(kernel.place_leaves(page, r.data, 2, -1, r.pos, 1, 1))
        if off_head != 0:
            set_next_offset(page, off_head, off_leaf, rec)
        return
    leaf = r.leaf_tuple("new leaf tuple")
    r.finish()
    if blk.block_id == 0:
        # a DEAD chain head is replaced in place
        if new_page:
            init_page(page, _leaf_flags(stores_nulls))
        bp.page_index_tuple_delete(page, off_leaf)
        _add_at(page, leaf, off_leaf, rec, "leaf tuple")
    elif blk.block_id == 1 and off_parent != 0:
        update_node_link(page, off_parent, node_i, _other_blkno(rec, 0), off_leaf, rec)
    else:
        raise _no_block(rec, blk)


def _move_leafs(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    r = _Reader(rec)
    nmoves, new_page, replace_dead, stores_nulls, off_parent, node_i, xid, is_build = r.fixed(_MOVE_LEAFS)
    ninsert = 1 if replace_dead else nmoves + 1
    delete_at = r.skip(2 * nmoves, "toDelete")
    to_insert = r.offsets(ninsert, "toInsert")
    insert_at = r.pos - 2 * ninsert
    dst = _other_blkno(rec, 1)
    bid = blk.block_id
    if bid == 1:
        if new_page:
            init_page(page, _leaf_flags(stores_nulls))
        # the leaf tuples are parsed (every one checked) before the page changes; the record's
        # own end is checked after (an error discards the page either way)
        r.finish_at(kernel.place_leaves(page, r.data, insert_at, -1, r.pos, ninsert, 1))
        return
    r.finish_at(kernel.skip_leaves(r.data, r.pos, ninsert))
    if bid == 0:
        first = SPGIST_PLACEHOLDER if is_build else SPGIST_REDIRECT
        multi_delete(page, rec, delete_at, nmoves, first, SPGIST_PLACEHOLDER, dst, to_insert[-1], xid)
    elif bid == 2:
        update_node_link(page, off_parent, node_i, dst, to_insert[-1], rec)
    else:
        raise _no_block(rec, blk)


def _add_node(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    r = _Reader(rec)
    offnum, off_new, new_page, parent_blk, off_parent, node_i, xid, is_build = r.fixed(_ADD_NODE)
    inner = r.inner_tuple("new inner tuple")
    r.finish()
    bid = blk.block_id
    if rec.block(1) is None:
        # the bigger tuple fits in place
        if bid != 0:
            raise _no_block(rec, blk)
        bp.page_index_tuple_delete(page, offnum)
        _add_at(page, inner, offnum, rec, "inner tuple")
        return
    blkno_new = _other_blkno(rec, 1)
    if bid == 1:
        if new_page:
            init_page(page, 0)  # ADD_NODE never happens in the nulls tree
        add_or_replace(page, inner, off_new, rec)
        if parent_blk == 1:
            update_node_link(page, off_parent, node_i, blkno_new, off_new, rec)
    elif bid == 0:
        if is_build:
            dead = form_dead(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, xid)
        else:
            dead = form_dead(SPGIST_REDIRECT, blkno_new, off_new, xid)
        bp.page_index_tuple_delete(page, offnum)
        _add_at(page, dead, offnum, rec, "redirect tuple")
        _add_counter(page, rec, 2 if is_build else 1, 1, "placeholder" if is_build else "redirection")
        if parent_blk == 0:
            update_node_link(page, off_parent, node_i, blkno_new, off_new, rec)
    elif bid == 2 and parent_blk == 2:
        update_node_link(page, off_parent, node_i, blkno_new, off_new, rec)
    else:
        raise _no_block(rec, blk)


def _split_tuple(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    r = _Reader(rec)
    off_prefix, off_postfix, new_page, postfix_same = r.fixed(_SPLIT_TUPLE)
    prefix = r.inner_tuple("prefix tuple")
    postfix = r.inner_tuple("postfix tuple")
    r.finish()
    if blk.block_id == 1 and not postfix_same:
        if new_page:
            init_page(page, 0)  # SPLIT_TUPLE never happens in the nulls tree
        add_or_replace(page, postfix, off_postfix, rec)
    elif blk.block_id == 0:
        bp.page_index_tuple_delete(page, off_prefix)
        _add_at(page, prefix, off_prefix, rec, "prefix tuple")
        if postfix_same:
            add_or_replace(page, postfix, off_postfix, rec)
    else:
        raise _no_block(rec, blk)


def _picksplit(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    r = _Reader(rec)
    (
        is_root_split, ndelete, ninsert, init_src, init_dest, off_inner, init_inner,
        stores_nulls, inner_is_parent, off_parent, node_i, xid, is_build,
    ) = r.fixed(_PICKSPLIT)
    delete_at = r.skip(2 * ndelete, "toDelete")
    insert_at = r.skip(2 * ninsert, "toInsert")
    select_at = r.skip(ninsert, "leafPageSelect")
    inner = r.inner_tuple("new inner tuple")
    leaves_at = r.pos
    blkno_inner = _other_blkno(rec, 2)
    bid = blk.block_id
    if bid == 0 and not is_root_split:
        if init_src:
            init_page(page, _leaf_flags(stores_nulls))
        elif is_build:
            multi_delete(page, rec, delete_at, ndelete, SPGIST_PLACEHOLDER, SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, xid)
        else:
            multi_delete(page, rec, delete_at, ndelete, SPGIST_REDIRECT, SPGIST_PLACEHOLDER, blkno_inner, off_inner, xid)
    elif bid == 1:
        if init_dest:
            init_page(page, _leaf_flags(stores_nulls))
    elif bid in (2, 3):
        r.finish_at(kernel.skip_leaves(r.data, leaves_at, ninsert))
        if bid == 2:
            if init_inner:
                init_page(page, SPGIST_NULLS if stores_nulls else 0)
            add_or_replace(page, inner, off_inner, rec)
        if bid == 3 or inner_is_parent:
            update_node_link(page, off_parent, node_i, blkno_inner, off_inner, rec)
        return
    else:
        raise _no_block(rec, blk)
    # the leaf tuples for this page (source: selector 0, destination: selector 1), parsed
    # (every one checked) before any is placed; the record's own end is checked after
    r.finish_at(kernel.place_leaves(page, r.data, insert_at, select_at, leaves_at, ninsert, 1 if bid == 1 else 0))


def _vacuum_leaf(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _no_block(rec, blk)
    r = _Reader(rec)
    ndead, nplaceholder, nmove, nchain, _xid, _is_build = r.fixed(_VACUUM_LEAF)
    dead_at = r.skip(2 * ndead, "toDead")
    placeholder_at = r.skip(2 * nplaceholder, "toPlaceholder")
    move_src = r.offsets(nmove, "moveSrc")
    move_src_at = r.pos - 2 * nmove
    move_dest = r.offsets(nmove, "moveDest")
    chain_src = r.offsets(nchain, "chainSrc")
    chain_dest = r.offsets(nchain, "chainDest")
    r.finish()
    multi_delete(page, rec, dead_at, ndead, SPGIST_DEAD, SPGIST_DEAD, INVALID_BLOCK, 0, 0)
    multi_delete(page, rec, placeholder_at, nplaceholder, SPGIST_PLACEHOLDER, SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0)
    maxoff = bp.max_offset(page)
    for s, d in zip(move_src, move_dest, strict=True):
        if not (1 <= s <= maxoff and 1 <= d <= maxoff):
            raise _err(rec, f"move {s} -> {d} names a line pointer past {maxoff}")
        ps, pd = bp.itemid_pos(s), bp.itemid_pos(d)
        page[ps : ps + 4], page[pd : pd + 4] = page[pd : pd + 4], page[ps : ps + 4]
    multi_delete(page, rec, move_src_at, nmove, SPGIST_PLACEHOLDER, SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0)
    for s, d in zip(chain_src, chain_dest, strict=True):
        pos, _ = _item_pos(page, s, rec)
        if page[pos] & 3 != SPGIST_LIVE:
            raise _err(rec, f"chain link of a tuple that is not live (offset {s})")
        set_next_offset(page, s, d, rec)


def _vacuum_root(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _no_block(rec, blk)
    r = _Reader(rec)
    (ndelete, _xid, _is_build) = r.fixed(_VACUUM_ROOT)
    to_delete = r.offsets(ndelete, "toDelete")
    r.finish()
    bp.page_index_multi_delete(page, to_delete)


def _vacuum_redirect(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if blk.block_id != 0:
        raise _no_block(rec, blk)
    r = _Reader(rec)
    nto, first_placeholder, _newest = r.fixed(_VACUUM_REDIRECT)
    offsets = r.offsets(nto, "itemToPlaceholder")
    r.finish()
    for off in offsets:
        pos, length = _item_pos(page, off, rec)
        if page[pos] & 3 != SPGIST_REDIRECT or length < SGDTSIZE:
            raise _err(rec, f"tuple at offset {off} is not a redirect")
        page[pos] = (page[pos] & ~3) | SPGIST_PLACEHOLDER
        _TID.pack_into(page, pos + 6, 0xFFFF, 0xFFFF, 0)
    _add_counter(page, rec, 1, -nto, "redirection")
    _add_counter(page, rec, 2, nto, "placeholder")
    if first_placeholder != 0:
        maxoff = bp.max_offset(page)
        n = maxoff - first_placeholder + 1
        if n < 0:
            raise _err(rec, f"firstPlaceholder {first_placeholder} is past the last offset {maxoff}")
        _add_counter(page, rec, 2, -n, "placeholder")
        bp.page_index_multi_delete(page, range(first_placeholder, maxoff + 1))


_ROUTINES = {
    XLOG_SPGIST_ADD_LEAF: _add_leaf,
    XLOG_SPGIST_MOVE_LEAFS: _move_leafs,
    XLOG_SPGIST_ADD_NODE: _add_node,
    XLOG_SPGIST_SPLIT_TUPLE: _split_tuple,
    XLOG_SPGIST_PICKSPLIT: _picksplit,
    XLOG_SPGIST_VACUUM_LEAF: _vacuum_leaf,
    XLOG_SPGIST_VACUUM_ROOT: _vacuum_root,
    XLOG_SPGIST_VACUUM_REDIRECT: _vacuum_redirect,
}


def redo_spgist(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    routine = _ROUTINES.get(rec.xl_info & 0xF0)
    if routine is None:
        raise _err(rec, f"unknown SP-GiST record type {rec.xl_info & 0xF0:#x}")
    routine(page, rec, blk)
    bp.page_set_lsn(page, rec.end_lsn)
