"""XLOG resource manager (rmid 0) redo and full-page images.

XLOG/FPI and FPI_FOR_HINT carry nothing but block images; restoring an image is the same for
every record (``restore_image``). An FPI block without an image to apply cannot be rebuilt:
that is an error, never a guess. FPI_FOR_HINT without an image (full_page_writes off) only
announced hint bits, so it changes nothing, as in PostgreSQL. XLOG records without block references
(checkpoints, NEXTOID, SWITCH, ...) have no page effect.
"""

from __future__ import annotations

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from protocol.errors import RemoteProtocolError
from protocol.wal.record import BlockRef, DecodedRecord
from protocol.wal.rmgr import (
    XLOG_FPI,
    XLOG_FPI_FOR_HINT,
)


def restore_image(blk: BlockRef, end_lsn: int) -> bytearray:
    """XLogReadBufferForRedo's BLK_RESTORED: the image, stamped with the record's end LSN
    unless it is an all-new page."""
    try:
        img = blk.image
    except RemoteProtocolError as exc:
        raise RedoError(f"cannot restore block image: {exc.msg}", lsn=end_lsn) from None
    if img is None:
        raise RedoError("block reference has no image", lsn=end_lsn)
    page = bytearray(img)
    if not bp.page_is_new(page):
        bp.page_set_lsn(page, end_lsn)
    return page


def redo_xlog(page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
    """Reached only for blocks without an image to apply."""
    info = rec.xl_info & 0xF0
    if info == XLOG_FPI_FOR_HINT and not blk.has_image:
        # full_page_writes was off: the record only said "hint bits changed"; nothing to do
        return
    kind = "FPI" if info == XLOG_FPI else "FPI_FOR_HINT" if info == XLOG_FPI_FOR_HINT else f"{info:#x}"
    raise RedoError(
        f"XLOG/{kind} block {blk.block_id} has no image to apply", lsn=rec.end_lsn, rmgr="XLOG"
    )
