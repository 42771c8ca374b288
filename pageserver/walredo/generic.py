"""Generic WAL (rmid 20) redo: PostgreSQL 15's ``generic_xlog.c`` applied to one page.

Extensions without a resource manager of their own (contrib ``bloom``, and any that use
``GenericXLogStart``/``GenericXLogFinish``) log up to four pages per record, all standard
pages. A page registered as GENERIC_XLOG_FULL_IMAGE carries a forced image, which the manager
restores. Every other page carries a *delta* as its block data: fragments
``offset u16, length u16, length bytes``, each copied to the page at ``offset``, in order.
The delta says nothing about the hole between pd_lower and pd_upper, so redo zeroes it, as
the primary did when it installed the new page; then pd_lsn becomes the record's end.

A fragment that runs past the data or the page, or a page header whose pd_lower/pd_upper no
longer make sense after the delta, is a corrupt record: ``RedoError``, never a wrong page.
"""

from __future__ import annotations

import struct

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord

FRAGMENT_HEADER = struct.Struct("<HH")  # offset, length
MAX_GENERIC_XLOG_PAGES = 4


def _err(rec: DecodedRecord, blk: BlockRef, msg: str) -> RedoError:
    return RedoError(f"Generic/Generic block {blk.block_id}: {msg}", lsn=rec.end_lsn, rmgr="Generic")


def apply_delta(page: bytearray, delta: bytes | bytearray | memoryview) -> str | None:
    """applyPageRedo plus the hole zeroing: ``None``, or what is wrong with the delta."""
    pos = 0
    end = len(delta)
    unpack = FRAGMENT_HEADER.unpack_from
    while pos < end:
        if pos + 4 > end:
            return f"fragment header cut at byte {pos} of {end}"
        offset, length = unpack(delta, pos)
        pos += 4
        if pos + length > end:
            return f"fragment of {length} bytes at byte {pos} runs past the {end}-byte delta"
        if offset + length > bp.BLCKSZ:
            return f"fragment [{offset}, {offset + length}) runs past the page"
        page[offset : offset + length] = delta[pos : pos + length]
        pos += length
    lower, upper = bp.U16x2.unpack_from(page, bp.OFF_LOWER)
    if lower > upper or upper > bp.BLCKSZ:
        return f"after the delta pd_lower {lower} and pd_upper {upper} are not a page's"
    page[lower:upper] = bytes(upper - lower)
    return None


def redo_generic(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if rec.xl_info & 0xF0:
        raise _err(rec, blk, f"unknown record type {rec.xl_info & 0xF0:#x}")
    if blk.block_id >= MAX_GENERIC_XLOG_PAGES:
        raise _err(rec, blk, f"block id {blk.block_id}: a generic record has at most {MAX_GENERIC_XLOG_PAGES} pages")
    problem = apply_delta(page, blk.data)
    if problem is not None:
        raise _err(rec, blk, problem)
    bp.page_set_lsn(page, rec.end_lsn)
