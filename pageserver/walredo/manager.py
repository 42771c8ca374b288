"""The redo manager: rebuild one page (or SLRU page, relmap file) from a base and records.

``PostgresRedoManager.apply(key, base_image, records)`` is the storage engine's entry point
(``pageserver.storage.reconstruct.RedoManager``). Records come oldest first as stored values:
raw PostgreSQL records (``PostgresRecord``, keyed by their end LSN) and pagestore's own
records (VM bits, CLOG status, multixacts, VM truncation, ``Test``).

For a raw record the manager finds the block reference that names the requested page and
follows PostgreSQL's ``XLogReadBufferForRedo``: an image flagged APPLY replaces the page; a
WILL_INIT block starts from zeros; a page whose LSN is at or past the record's end is left
alone; anything else goes to the resource manager's redo routine. A record of a resource
manager without redo here, or one that cannot be replayed on this page, raises
``PageReconstructError`` naming it: never a wrong page.

``validate``: when a block carries an image PostgreSQL logged only for verification
(wal_consistency_checking: an image without APPLY), the replayed page is compared with it
after the resource manager's mask; a difference raises ``RedoValidationError`` with the
record's LSN and bumps ``pageserver_walredo_validation_failures_total``.
"""

from __future__ import annotations

import struct
from collections import Counter as TallyCounter
from collections.abc import Callable, Sequence

import attrs
from prometheus_client import Counter

from pageserver.storage.key import (
    SECTION_REL,
    SECTION_SLRU,
    SLRU_CLOG,
    SLRU_COMMIT_TS,
    SLRU_MULTIXACT_MEMBERS,
    SLRU_MULTIXACT_OFFSETS,
    VISIBILITYMAP_FORKNUM,
    Key,
    key_fields,
)
from pageserver.storage.reconstruct import PageReconstructError, apply_test_records
from pageserver.storage.value import (
    ClearVisibilityMapFlags,
    ClogSetAborted,
    ClogSetCommitted,
    MultixactMembersCreate,
    MultixactOffsetCreate,
    PostgresRecord,
    TestRecord,
    TruncateVisibilityMap,
    WalRecordValue,
)
from pageserver.walredo import bufpage as bp
from pageserver.walredo import clog, commit_ts, multixact
from pageserver.walredo.brin import redo_brin
from pageserver.walredo.btree import redo_btree
from pageserver.walredo.errors import RedoError, RedoValidationError
from pageserver.walredo.generic import redo_generic
from pageserver.walredo.gin import redo_gin
from pageserver.walredo.gist import redo_gist, redo_gist_on_image
from pageserver.walredo.hash import redo_hash, redo_hash_on_image
from pageserver.walredo.heap import redo_heap, redo_heap2, vm_clears
from pageserver.walredo.mask import RM_MASKS
from pageserver.walredo.sequence import redo_seq
from pageserver.walredo.spgist import redo_spgist
from pageserver.walredo.visibilitymap import (
    HEAPBLOCKS_PER_PAGE,
    heapblk_to_mapblock,
    vm_clear_in_page,
    vm_truncate_page,
)
from pageserver.walredo.xlog import redo_xlog, restore_image
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn
from protocol.wal.record import BlockRef, DecodedRecord, decode_record
from protocol.wal.rmgr import (
    CLOG_ZEROPAGE,
    COMMIT_TS_ZEROPAGE,
    SMGR_TRUNCATE_VM,
    XLOG_MULTIXACT_CREATE_ID,
    XLOG_MULTIXACT_ZERO_MEM_PAGE,
    XLOG_MULTIXACT_ZERO_OFF_PAGE,
    XLOG_RELMAP_UPDATE,
    XLOG_SMGR_TRUNCATE,
    RmgrId,
    record_type_name,
    rmgr_name,
)

RELMAP_FILE_SIZE = 512

RedoFn = Callable[[bytearray, DecodedRecord, BlockRef], None]

REDO_ROUTINES: dict[int, RedoFn] = {
    RmgrId.XLOG: redo_xlog,
    RmgrId.HEAP: redo_heap,
    RmgrId.HEAP2: redo_heap2,
    RmgrId.BTREE: redo_btree,
    RmgrId.SEQ: redo_seq,
    RmgrId.SPGIST: redo_spgist,
    RmgrId.HASH: redo_hash,
    RmgrId.GENERIC: redo_generic,
    RmgrId.GIN: redo_gin,
    RmgrId.GIST: redo_gist,
    RmgrId.BRIN: redo_brin,
}
# Routines that also run after an applied image is restored, for the record types whose
# PostgreSQL redo changes the page on top of it (BLK_RESTORED handled like BLK_NEEDS_REDO).
ON_IMAGE_ROUTINES: dict[int, RedoFn] = {
    RmgrId.HASH: redo_hash_on_image,
    RmgrId.GIST: redo_gist_on_image,
}
# resource managers whose records never change relation pages
NO_PAGE_EFFECT = frozenset(
    {
        RmgrId.XLOG,
        RmgrId.XACT,
        RmgrId.SMGR,
        RmgrId.CLOG,
        RmgrId.DBASE,
        RmgrId.TBLSPC,
        RmgrId.MULTIXACT,
        RmgrId.RELMAP,
        RmgrId.STANDBY,
    }
)

VALIDATION_FAILURES = Counter(
    "pageserver_walredo_validation_failures",
    "replayed pages that differed (masked) from PostgreSQL's wal_consistency_checking image",
)
VALIDATION_CHECKS = Counter(
    "pageserver_walredo_validation_checks",
    "replayed pages compared (masked) with a wal_consistency_checking image",
)
REDO_RECORDS = Counter("pageserver_walredo_records", "WAL records applied by the redo manager")

_XL_SMGR_TRUNCATE = struct.Struct("<IIIIi")  # blkno, spc, db, rel, flags
_XL_RELMAP_UPDATE = struct.Struct("<IIi")  # dbid, tsid, nbytes


@attrs.frozen(slots=True)
class RelBlock:
    spc: int
    db: int
    rel: int
    fork: int
    blkno: int


@attrs.frozen(slots=True)
class SlruPage:
    kind: int
    pageno: int


@attrs.frozen(slots=True)
class RelmapFile:
    spc: int
    db: int


Target = RelBlock | SlruPage | RelmapFile


def target_of_key(key: bytes) -> Target:
    f1, f2, f3, f4, f5, f6 = key_fields(key)
    if f1 == SECTION_REL and f4 != 0 and f6 != 0xFFFF_FFFF:
        return RelBlock(f2, f3, f4, f5, f6)
    if f1 == SECTION_REL and f4 == 0 and f5 == 0 and f6 == 0 and (f2 or f3):
        return RelmapFile(f2, f3)
    if f1 == SECTION_SLRU and f3 == 1 and f6 != 0xFFFF_FFFF:
        return SlruPage(f2, f4 * clog.SLRU_PAGES_PER_SEGMENT + f6)
    raise RedoError(f"key {key.hex()} is not a page redo can rebuild")


def record_name(rec: DecodedRecord) -> str:
    return f"{rmgr_name(rec.xl_rmid)}/{record_type_name(rec.xl_rmid, rec.xl_info)}"


def find_block(rec: DecodedRecord, t: RelBlock) -> BlockRef | None:
    for b in rec.blocks:
        if b.blkno == t.blkno and b.forknum == t.fork and b.rel == t.rel and b.db == t.db and b.spc == t.spc:
            return b
    return None


@attrs.define
class RedoStats:
    """Counts per record type; what tests and benchmarks print."""

    applied: TallyCounter[str] = attrs.field(factory=TallyCounter)
    validated: TallyCounter[str] = attrs.field(factory=TallyCounter)


class PostgresRedoManager:
    """Pure-Python redo of PostgreSQL 15 records, page by page (the storage engine's RedoManager)."""

    def __init__(self, *, validate: bool = False, count: bool = False) -> None:
        self.validate = validate
        self.count = count
        self.stats = RedoStats()

    # --- the storage engine's entry point ------------------------------------------------

    def apply(
        self, key: Key, base_image: bytes | None, records: list[tuple[Lsn, WalRecordValue]]
    ) -> bytes:
        try:
            if records and all(isinstance(v, TestRecord) for _, v in records):
                return apply_test_records(key, base_image, records)
            target = target_of_key(key)
            return self.apply_to_target(target, base_image, records)
        except RedoError as exc:
            lsn = exc.lsn if exc.lsn is not None else (records[-1][0] if records else 0)
            raise PageReconstructError(key, lsn, str(exc)) from exc

    def apply_to_target(
        self, target: Target, base_image: bytes | None, records: Sequence[tuple[int, WalRecordValue]]
    ) -> bytes:
        if isinstance(target, RelmapFile):
            return self._apply_relmap(target, base_image, records)
        page: bytearray | None = bytearray(base_image) if base_image is not None else None
        for lsn, value in records:
            page = self._apply_one(target, page, lsn, value)
        if page is None:
            raise RedoError("no base image and no record initialized the page")
        return bytes(page)

    def _apply_one(self, target: RelBlock | SlruPage, page: bytearray | None, lsn: int, value: WalRecordValue) -> bytearray | None:
        if isinstance(value, PostgresRecord):
            try:
                rec = decode_record(value.rec, lsn, lsn)
            except RemoteProtocolError as exc:
                raise RedoError(f"undecodable stored record: {exc.msg}", lsn=lsn) from None
            if isinstance(target, RelBlock):
                return self.redo_page(target, page, rec)
            if page is None and value.will_init:
                page = bytearray(bp.BLCKSZ)  # a record that starts an SLRU page (commit_ts: the unlogged first page)
            return self._redo_slru(target, page, rec)
        if isinstance(value, TestRecord):
            raise RedoError("a Test record mixed with PostgreSQL records", lsn=lsn)
        if page is None:
            raise RedoError(f"{type(value).__name__} needs a base page", lsn=lsn)
        if isinstance(target, RelBlock):
            if isinstance(value, ClearVisibilityMapFlags):
                for heapblk in (value.new_heap_blkno, value.old_heap_blkno):
                    if heapblk is None:
                        continue
                    if heapblk_to_mapblock(heapblk) != target.blkno:
                        raise RedoError(f"VM bits of heap block {heapblk} are not on VM page {target.blkno}", lsn=lsn)
                    vm_clear_in_page(page, heapblk, value.flags)
                    if not bp.page_is_new(page):
                        bp.page_set_lsn(page, lsn)
                return page
            if isinstance(value, TruncateVisibilityMap):
                vm_truncate_page(page, value.trunc_byte, value.trunc_offs)
                return page
        elif target.kind == SLRU_CLOG and isinstance(value, ClogSetCommitted | ClogSetAborted):
            status = clog.TRANSACTION_STATUS_COMMITTED if isinstance(value, ClogSetCommitted) else clog.TRANSACTION_STATUS_ABORTED
            clog.clog_apply(page, target.pageno, value.xids, status)
            return page
        elif target.kind == SLRU_MULTIXACT_OFFSETS and isinstance(value, MultixactOffsetCreate):
            multixact.set_offset(page, target.pageno, value.mid, value.moff)
            return page
        elif target.kind == SLRU_MULTIXACT_MEMBERS and isinstance(value, MultixactMembersCreate):
            multixact.set_members(page, target.pageno, value.moff, value.members)
            return page
        raise RedoError(f"{type(value).__name__} does not apply to {target}", lsn=lsn)

    # --- relation pages -----------------------------------------------------------------

    def redo_page(self, target: RelBlock, page: bytearray | None, rec: DecodedRecord) -> bytearray | None:
        """Replay one decoded record on one relation page; returns the new page."""
        blk = find_block(rec, target)
        if blk is None:
            return self._redo_unreferenced(target, page, rec)
        lsn = rec.end_lsn
        if self.count:
            self.stats.applied[record_name(rec)] += 1
        if blk.apply_image:
            restored = restore_image(blk, lsn)
            on_image = ON_IMAGE_ROUTINES.get(rec.xl_rmid)
            if on_image is not None:
                self._run(on_image, restored, rec, blk)
            return restored
        if blk.will_init:
            page = bytearray(bp.BLCKSZ)
        elif page is None:
            raise RedoError(f"{record_name(rec)} needs the page but there is no base image", lsn=lsn)
        elif bp.page_get_lsn(page) >= lsn:
            # BLK_DONE: the page already contains this change
            if self.validate and blk.has_image:
                self._validate(page, rec, blk)
            return page
        routine = REDO_ROUTINES.get(rec.xl_rmid)
        if routine is None:
            raise RedoError(
                f"no redo for resource manager {rmgr_name(rec.xl_rmid)} ({record_name(rec)})",
                lsn=lsn,
                rmgr=rmgr_name(rec.xl_rmid),
            )
        self._run(routine, page, rec, blk)
        REDO_RECORDS.inc()
        if self.validate and blk.has_image:
            self._validate(page, rec, blk)
        return page

    @staticmethod
    def _run(routine: RedoFn, page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
        lsn = rec.end_lsn
        try:
            routine(page, rec, blk)
        except bp.PageError as exc:
            raise RedoError(f"{record_name(rec)}: {exc}", lsn=lsn, rmgr=rmgr_name(rec.xl_rmid)) from None
        except (struct.error, IndexError, ValueError, AssertionError) as exc:
            # a record that does not fit the page (hostile or corrupt input)
            raise RedoError(f"{record_name(rec)}: malformed record ({exc})", lsn=lsn, rmgr=rmgr_name(rec.xl_rmid)) from None

    def _validate(self, page: bytearray, rec: DecodedRecord, blk: BlockRef) -> None:
        """verifyBackupPageConsistency: compare rm_mask(replayed) with rm_mask(image)."""
        try:
            img = blk.image
        except RemoteProtocolError as exc:
            raise RedoError(
                f"{record_name(rec)}: cannot restore the verification image: {exc.msg}",
                lsn=rec.end_lsn, rmgr=rmgr_name(rec.xl_rmid),
            ) from None
        assert img is not None
        mask = RM_MASKS.get(rec.xl_rmid)
        VALIDATION_CHECKS.inc()
        if self.count:
            self.stats.validated[record_name(rec)] += 1
        if bp.page_get_lsn(page) > rec.end_lsn:
            return
        mine = bytearray(page)
        theirs = bytearray(img)
        if mask is not None:
            mask(mine, blk.blkno)
            mask(theirs, blk.blkno)
        if mine != theirs:
            VALIDATION_FAILURES.inc()
            first = next(i for i in range(bp.BLCKSZ) if mine[i] != theirs[i])
            raise RedoValidationError(
                f"inconsistent page found for {record_name(rec)}, rel {blk.spc}/{blk.db}/{blk.rel}"
                f" fork {blk.forknum} blk {blk.blkno}: first difference at byte {first}",
                lsn=rec.end_lsn,
                rmgr=rmgr_name(rec.xl_rmid),
            )

    def _redo_unreferenced(self, target: RelBlock, page: bytearray | None, rec: DecodedRecord) -> bytearray | None:
        """A record stored under a page it does not reference: VM bits, VM truncation, or no effect."""
        lsn = rec.end_lsn
        if target.fork == VISIBILITYMAP_FORKNUM and rec.xl_rmid in (RmgrId.HEAP, RmgrId.HEAP2):
            clears = vm_clears(rec)
            if not clears:
                raise RedoError(f"{record_name(rec)} does not touch VM page {target.blkno}", lsn=lsn)
            if page is None:
                return None
            for heapblk, flags in clears:
                if heapblk_to_mapblock(heapblk) == target.blkno:
                    vm_clear_in_page(page, heapblk, flags)
            if self.count:
                self.stats.applied[record_name(rec) + " (vm)"] += 1
            return page
        if rec.xl_rmid == RmgrId.SMGR and rec.xl_info & 0xF0 == XLOG_SMGR_TRUNCATE:
            if len(rec.main_data) < _XL_SMGR_TRUNCATE.size:
                raise RedoError("truncated Storage/TRUNCATE record", lsn=lsn, rmgr="Storage")
            nblocks, spc, db, rel, flags = _XL_SMGR_TRUNCATE.unpack_from(rec.main_data)
            if (
                target.fork == VISIBILITYMAP_FORKNUM
                and flags & SMGR_TRUNCATE_VM
                and (spc, db, rel) == (target.spc, target.db, target.rel)
                and page is not None
                and heapblk_to_mapblock(nblocks) == target.blkno
            ):
                byte = (nblocks % HEAPBLOCKS_PER_PAGE) // 4
                offs = (nblocks % 4) * 2
                if byte or offs:
                    vm_truncate_page(page, byte, offs)
            return page
        if rec.xl_rmid in NO_PAGE_EFFECT:
            return page
        raise RedoError(
            f"{record_name(rec)} does not reference {target}", lsn=lsn, rmgr=rmgr_name(rec.xl_rmid)
        )

    # --- SLRU pages and relmap files ----------------------------------------------------

    def _redo_slru(self, target: SlruPage, page: bytearray | None, rec: DecodedRecord) -> bytearray:
        lsn = rec.end_lsn
        rmid = rec.xl_rmid
        info = rec.xl_info & 0xF0
        if self.count:
            self.stats.applied[record_name(rec)] += 1
        if target.kind == SLRU_CLOG:
            if rmid == RmgrId.CLOG and info == CLOG_ZEROPAGE:
                return bytearray(bp.BLCKSZ)
            if rmid == RmgrId.XACT:
                parsed = clog.parse_xact_xids(rec.xl_info, rec.xl_xid, rec.main_data, lsn)
                if parsed is not None:
                    if page is None:
                        raise RedoError("CLOG page has no base image", lsn=lsn)
                    clog.clog_apply(page, target.pageno, parsed[1], parsed[0])
                    return page
        elif target.kind == SLRU_COMMIT_TS:
            if rmid == RmgrId.COMMIT_TS and info == COMMIT_TS_ZEROPAGE:
                return bytearray(bp.BLCKSZ)
            if rmid == RmgrId.XACT:
                commit = commit_ts.parse_commit(rec.xl_info, rec.xl_xid, rec.main_data, lsn)
                if commit is not None:
                    if page is None:
                        raise RedoError("commit_ts page has no base image", lsn=lsn)
                    commit_ts.set_entries(page, target.pageno, commit[1], commit[0], rec.origin or 0)
                    return page
        elif rmid == RmgrId.MULTIXACT:
            if info in (XLOG_MULTIXACT_ZERO_OFF_PAGE, XLOG_MULTIXACT_ZERO_MEM_PAGE):
                return bytearray(bp.BLCKSZ)
            if info == XLOG_MULTIXACT_CREATE_ID:
                if page is None:
                    raise RedoError("MultiXact page has no base image", lsn=lsn)
                mid, moff, members = multixact.parse_create(rec.main_data, lsn)
                if target.kind == SLRU_MULTIXACT_OFFSETS:
                    multixact.set_offset(page, target.pageno, mid, moff)
                    multixact.set_offset(page, target.pageno, *multixact.next_multi_offset(mid, moff, len(members)))
                elif target.kind == SLRU_MULTIXACT_MEMBERS:
                    multixact.set_members(page, target.pageno, moff, members)
                return page
        raise RedoError(f"{record_name(rec)} has no effect defined on SLRU page {target}", lsn=lsn, rmgr=rmgr_name(rmid))

    def _apply_relmap(self, target: RelmapFile, base: bytes | None, records: Sequence[tuple[int, WalRecordValue]]) -> bytes:
        data = base
        for lsn, value in records:
            if not isinstance(value, PostgresRecord):
                raise RedoError(f"{type(value).__name__} does not apply to a relmap file", lsn=lsn)
            try:
                rec = decode_record(value.rec, lsn, lsn)
            except RemoteProtocolError as exc:
                raise RedoError(f"undecodable stored record: {exc.msg}", lsn=lsn) from None
            if rec.xl_rmid != RmgrId.RELMAP or rec.xl_info & 0xF0 != XLOG_RELMAP_UPDATE:
                raise RedoError(f"{record_name(rec)} does not apply to a relmap file", lsn=lsn)
            main = rec.main_data
            if len(main) < _XL_RELMAP_UPDATE.size:
                raise RedoError("truncated RelMap/UPDATE record", lsn=lsn, rmgr="RelMap")
            _db, _ts, nbytes = _XL_RELMAP_UPDATE.unpack_from(main)
            # relmap_redo insists on a whole RelMapFile; anything else is corrupt WAL.
            if nbytes != RELMAP_FILE_SIZE or len(main) < _XL_RELMAP_UPDATE.size + nbytes:
                raise RedoError(
                    f"RelMap/UPDATE carries {nbytes} bytes ({len(main) - _XL_RELMAP_UPDATE.size} present),"
                    f" not a {RELMAP_FILE_SIZE}-byte map file",
                    lsn=lsn, rmgr="RelMap",
                )
            data = bytes(main[_XL_RELMAP_UPDATE.size : _XL_RELMAP_UPDATE.size + nbytes])
        if data is None:
            raise RedoError("relmap file without base or update")
        return data
