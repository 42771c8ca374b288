"""Check redo against real WAL: every block image PostgreSQL logged for verification.

With ``wal_consistency_checking = 'all'`` PostgreSQL attaches to every block reference the page
as it was right after the change. ``verify_records`` keeps a "current page" per block, starting
from an applied image, a WILL_INIT record, or (when the page was first seen without either)
the first verification image; it replays each record with ``PostgresRedoManager`` (validating)
and collects mismatches instead of stopping, so one run reports every broken record type.
VM pages are also compared bit for bit (LSN and checksum masked): PostgreSQL's ``heap_mask``
would hide the whole bitmap.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError, RedoValidationError
from pageserver.walredo.heap import vm_clears
from pageserver.walredo.manager import (
    PostgresRedoManager,
    RelBlock,
    record_name,
)
from pageserver.walredo.mask import fsm_vm_mask, masked
from pageserver.walredo.visibilitymap import HEAPBLOCKS_PER_PAGE, heapblk_to_mapblock
from protocol.lsn import WAL_SEGMENT_SIZE, format_lsn, segment_file_name
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import VISIBILITYMAP_FORKNUM, DecodedRecord
from protocol.wal.rmgr import SMGR_TRUNCATE_VM, XLOG_SMGR_TRUNCATE, RmgrId

# A PostgreSQL that records WAL for ``verify_records``: a verification image on every block
# reference, and every segment and record kept (no checkpoint or autovacuum in between).
VERIFY_SETTINGS: dict[str, str] = {
    "wal_consistency_checking": "all",
    "full_page_writes": "on",
    "wal_level": "replica",
    "autovacuum": "off",
    "wal_keep_size": "4GB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "1h",
    "fsync": "off",
    "synchronous_commit": "off",
}


def read_wal(wal_dir: Path, start_lsn: int, end_lsn: int) -> Iterator[DecodedRecord]:
    """Records that start in [start_lsn, end_lsn), read from a pg_wal directory."""
    dec = WalStreamDecoder(start_lsn)
    segno = start_lsn // WAL_SEGMENT_SIZE
    seg_start = segno * WAL_SEGMENT_SIZE
    # feed from the start of the page holding start_lsn
    offset = (start_lsn - seg_start) & ~(bp.BLCKSZ - 1)
    dec = WalStreamDecoder(start_lsn, data_start=seg_start + offset)
    while True:
        path = wal_dir / segment_file_name(segno)
        if not path.exists():
            return
        with path.open("rb") as f:
            f.seek(offset)
            dec.feed(f.read())
        for rec in dec.records():
            if rec.lsn >= end_lsn:
                return
            yield rec
        if dec.ended is not None:
            return
        segno += 1
        offset = 0


@attrs.define
class VerifyReport:
    records: int = 0
    checked: Counter[str] = attrs.field(factory=Counter)
    restored: Counter[str] = attrs.field(factory=Counter)
    vm_checked: int = 0
    adopted: int = 0
    unchecked_blocks: int = 0
    failures: list[str] = attrs.field(factory=list)
    pages: dict[RelBlock, bytearray] = attrs.field(factory=dict)

    def summary(self) -> str:
        lines = [f"{self.records} records; block checks per record type:"]
        lines += [f"  {name:32s} {n:7d}" for name, n in sorted(self.checked.items())]
        lines.append("full-page images applied per record type:")
        lines += [f"  {name:32s} {n:7d}" for name, n in sorted(self.restored.items())]
        lines.append(
            f"VM pages compared bit for bit: {self.vm_checked}; pages first seen without a base"
            f" (adopted their verification image): {self.adopted}; blocks without any image: "
            f"{self.unchecked_blocks}; failures: {len(self.failures)}"
        )
        return "\n".join(lines)


_SMGR_TRUNCATE = struct.Struct("<IIIIi")  # blkno, spc, db, rel, flags
SMGR_TRUNCATE_HEAP = 0x0001


def _truncate_tracked(mgr: PostgresRedoManager, pages: dict[RelBlock, bytearray], rec: DecodedRecord) -> None:
    """Storage/TRUNCATE: forget pages past the cut; clear VM bits past it (manager does)."""
    nblocks, spc, db, rel, flags = _SMGR_TRUNCATE.unpack_from(rec.main_data)
    mapblock = heapblk_to_mapblock(nblocks)
    partial = nblocks % HEAPBLOCKS_PER_PAGE != 0
    for t in [t for t in pages if (t.spc, t.db, t.rel) == (spc, db, rel)]:
        if t.fork == 0 and flags & SMGR_TRUNCATE_HEAP and t.blkno >= nblocks:
            del pages[t]
        elif t.fork == VISIBILITYMAP_FORKNUM and flags & SMGR_TRUNCATE_VM:
            if t.blkno > mapblock or (t.blkno == mapblock and not partial):
                del pages[t]
            elif t.blkno == mapblock:
                mgr.redo_page(t, pages[t], rec)


def verify_records(records: Iterable[DecodedRecord], max_failures: int = 50) -> VerifyReport:
    mgr = PostgresRedoManager(validate=True)
    report = VerifyReport()
    pages = report.pages
    for rec in records:
        report.records += 1
        for blk in rec.blocks:
            t = RelBlock(blk.spc, blk.db, blk.rel, blk.forknum, blk.blkno)
            cur = pages.get(t)
            if cur is None and not blk.apply_image and not blk.will_init:
                if blk.has_image and blk.image is not None:
                    page = bytearray(blk.image)
                    if not bp.page_is_new(page):
                        bp.page_set_lsn(page, rec.end_lsn)
                    pages[t] = page
                    report.adopted += 1
                else:
                    report.unchecked_blocks += 1
                continue
            try:
                new = mgr.redo_page(t, cur, rec)
            except RedoValidationError as exc:
                report.failures.append(f"{format_lsn(rec.lsn)} {record_name(rec)}: {exc}")
                img = blk.image
                if img is not None:
                    pages[t] = bytearray(img)
                continue
            except RedoError as exc:
                report.failures.append(f"{format_lsn(rec.lsn)} {record_name(rec)}: {exc}")
                pages.pop(t, None)
                continue
            if new is None:
                continue
            pages[t] = new
            if blk.apply_image:
                report.restored[record_name(rec)] += 1
            elif blk.has_image:
                report.checked[record_name(rec)] += 1
                if blk.forknum == VISIBILITYMAP_FORKNUM:
                    img = blk.image
                    assert img is not None
                    report.vm_checked += 1
                    if masked(new, blk.blkno, fsm_vm_mask) != masked(img, blk.blkno, fsm_vm_mask):
                        report.failures.append(f"{format_lsn(rec.lsn)} {record_name(rec)}: VM page {t} differs")
                        pages[t] = bytearray(img)
        if rec.xl_rmid in (RmgrId.HEAP, RmgrId.HEAP2):
            b0 = rec.block(0)
            for heapblk, _flags in vm_clears(rec):
                assert b0 is not None
                vt = RelBlock(b0.spc, b0.db, b0.rel, VISIBILITYMAP_FORKNUM, heapblk_to_mapblock(heapblk))
                vm = pages.get(vt)
                if vm is not None:
                    mgr.redo_page(vt, vm, rec)
        if rec.xl_rmid == RmgrId.SMGR and rec.xl_info & 0xF0 == XLOG_SMGR_TRUNCATE:
            _truncate_tracked(mgr, pages, rec)
        if len(report.failures) >= max_failures:
            break
    return report
