"""Sequence (rmid 15) redo: every record rewrites the sequence's single page from scratch."""

from __future__ import annotations

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_SEQ_LOG,
)

SEQ_MAGIC = 0x1717
SIZEOF_XL_SEQ_REC = 12  # RelFileNode


def redo_seq(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    if rec.xl_info & 0xF0 != XLOG_SEQ_LOG:
        raise RedoError(f"unknown Sequence record info {rec.xl_info:#x}", lsn=rec.end_lsn, rmgr="Sequence")
    bp.page_init(page, 4)
    bp.U32.pack_into(page, bp.get_special(page), SEQ_MAGIC)
    item = rec.main_data[SIZEOF_XL_SEQ_REC:]
    if bp.page_add_item(page, item, 1, overwrite=False, is_heap=False) == 0:
        raise RedoError("seq_redo: failed to add item to page", lsn=rec.end_lsn, rmgr="Sequence")
    bp.page_set_lsn(page, rec.end_lsn)
