"""WAL ingest: every decoded PostgreSQL 15 record becomes values at its end LSN.

``WalIngest(timeline).ingest_record(rec)`` is the whole interface (plus ``ingest_wal_dir``
for WAL in segment files, and ``TimelineWalIngest`` which connects the
``WalReceiver`` to a timeline). ``ingest_records`` (a batch) and ``ingest_decoder`` (the fused
path: the commonest records straight from the decoder's bytes, no record objects) give the
same values for less CPU; docs/ingest.md describes both. What each record writes (docs/ingest.md has the table):

- every block reference: an XLOG/FPI or FPI_FOR_HINT block with an applied, uncompressed image
  becomes an ``Image`` (hole restored, pd_lsn = end LSN unless the page is new); any other
  block stores the whole raw record (``PostgresRecord``, ``will_init`` when the block is
  WILL_INIT or carries an applied image), whatever its resource manager. A block at or past
  the fork's size extends it (the gap gets zero pages; a fork that does not exist yet, such
  as a VM fork PostgreSQL creates without WAL, is created);
- Heap/Heap2 records whose flags clear visibility-map bits: ``ClearVisibilityMapFlags`` on the
  VM page (PostgreSQL does not reference that page in the record);
- Storage CREATE / TRUNCATE: fork creation and sizes (FSM tail page zeroed, VM tail bits
  cleared with ``TruncateVisibilityMap``);
- Database CREATE_FILE_COPY copies the template's relations and relmapper file as images;
  CREATE_WAL_LOG creates the directory (its contents follow as their own records); DROP
  removes the database from the directories;
- RelMap UPDATE: the relmapper file; Transaction COMMIT/ABORT (and the PREPARED forms): CLOG
  status per CLOG page for the xid and its subtransactions, relations dropped, two-phase files
  removed; PREPARE: the two-phase file;
- CLOG ZEROPAGE / TRUNCATE, MultiXact ZERO pages / CREATE_ID / TRUNCATE_ID: SLRU pages,
  segments and checkpoint fields;
- XLOG CHECKPOINT_* / NEXTOID and every record's xid: the checkpoint key (nextXid advances in
  steps of 1024, as Neon does, so that not every transaction rewrites it).

Records ending at or below ``last_record_lsn`` are skipped (they are already in), so a
restarted stream may overlap. ``finish_write`` runs once per record.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import structlog
import trio

from pageserver.pg_control import (
    SIZEOF_CHECKPOINT,
    CheckPoint,
    encode_control_file,
    parse_control_file,
)
from pageserver.pgdatadir import (
    DEFAULTTABLESPACE_OID,
    GLOBALTABLESPACE_OID,
    SLRU_PAGES_PER_SEGMENT,
    ZERO_PAGE,
    DatadirModification,
    DatadirWriter,
    RelKey,
)
from pageserver.storage.inmemory_layer import PutItem
from pageserver.storage.key import (
    FSM_FORKNUM,
    INIT_FORKNUM,
    MAIN_FORKNUM,
    SLRU_CLOG,
    SLRU_COMMIT_TS,
    SLRU_MULTIXACT_MEMBERS,
    SLRU_MULTIXACT_OFFSETS,
    VISIBILITYMAP_FORKNUM,
    Key,
    rel_block_key,
    rel_size_key,
    relmap_file_key,
)
from pageserver.storage.reconstruct import MissingKeyError
from pageserver.storage.value import (
    ClearVisibilityMapFlags,
    ClogSetAborted,
    ClogSetCommitted,
    Image,
    MultixactMembersCreate,
    PostgresRecord,
    TruncateVisibilityMap,
    Value,
    encode_postgres_record,
    encode_value,
)
from pageserver.timeline import Timeline
from pageserver.wal_receiver import (
    Connector,
    Progress,
    RemoteWal,
    WalReceiver,
    WalReceiverConfig,
    pgclient_connect,
)
from pageserver.walredo.clog import CLOG_XACTS_PER_PAGE as CLOG_XACTS_PER_PAGE
from pageserver.walredo.commit_ts import COMMIT_TS_XACTS_PER_PAGE, commit_ts_page_precedes
from pageserver.walredo.heap import vm_clears
from pageserver.walredo.multixact import next_multi_offset
from pageserver.walredo.visibilitymap import HEAPBLOCKS_PER_PAGE
from protocol.errors import RemoteProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn, format_lsn, segment_file_name
from protocol.pgwire.sqlstate import DATA_CORRUPTED
from protocol.wal import crc as _crcmod
from protocol.wal.ingest_kernel import WALK_REL, fused_walk, same_run
from protocol.wal.reader import (
    SIMPLE_HEADERS,
    SIMPLE_PAYLOAD_AT,
    SIMPLE_RECORD,
    EndOfWal,
    NeedData,
    WalStreamDecoder,
)
from protocol.wal.record import (
    BKPBLOCK_FORK_MASK,
    BKPBLOCK_HAS_DATA,
    BKPBLOCK_HAS_IMAGE,
    BKPBLOCK_SAME_REL,
    BKPBLOCK_WILL_INIT,
    BKPIMAGE_APPLY,
    SIZE_OF_XLOG_RECORD,
    XLOG_RECORD_HEADER,
    XLR_BLOCK_ID_DATA_SHORT,
    BlockRef,
    DecodedRecord,
    RelFileNode,
)
from protocol.wal.rmgr import (
    CLOG_TRUNCATE,
    CLOG_ZEROPAGE,
    COMMIT_TS_TRUNCATE,
    COMMIT_TS_ZEROPAGE,
    SMGR_TRUNCATE_FSM,
    SMGR_TRUNCATE_HEAP,
    SMGR_TRUNCATE_VM,
    XACT_XINFO_HAS_DBINFO,
    XACT_XINFO_HAS_DROPPED_STATS,
    XACT_XINFO_HAS_INVALS,
    XACT_XINFO_HAS_RELFILENODES,
    XACT_XINFO_HAS_SUBXACTS,
    XACT_XINFO_HAS_TWOPHASE,
    XLOG_CHECKPOINT_ONLINE,
    XLOG_CHECKPOINT_SHUTDOWN,
    XLOG_DBASE_CREATE_FILE_COPY,
    XLOG_DBASE_CREATE_WAL_LOG,
    XLOG_DBASE_DROP,
    XLOG_FPI,
    XLOG_FPI_FOR_HINT,
    XLOG_MULTIXACT_CREATE_ID,
    XLOG_MULTIXACT_TRUNCATE_ID,
    XLOG_MULTIXACT_ZERO_MEM_PAGE,
    XLOG_MULTIXACT_ZERO_OFF_PAGE,
    XLOG_NEXTOID,
    XLOG_PARAMETER_CHANGE,
    XLOG_RELMAP_UPDATE,
    XLOG_SMGR_CREATE,
    XLOG_SMGR_TRUNCATE,
    XLOG_TBLSPC_CREATE,
    XLOG_TBLSPC_DROP,
    XLOG_XACT_ABORT,
    XLOG_XACT_ABORT_PREPARED,
    XLOG_XACT_COMMIT,
    XLOG_XACT_COMMIT_PREPARED,
    XLOG_XACT_HAS_INFO,
    XLOG_XACT_OPMASK,
    XLOG_XACT_PREPARE,
    RmgrId,
)

log = structlog.get_logger(__name__)

# MultiXact SLRU geometry (multixact.c); CLOG_XACTS_PER_PAGE comes from walredo.clog
MULTIXACT_OFFSETS_PER_PAGE = XLOG_BLCKSZ // 4
MULTIXACT_MEMBERS_PER_PAGE = (XLOG_BLCKSZ // 20) * 4
MAX_MULTIXACT_OFFSET = 0xFFFF_FFFF
FIRST_NORMAL_XID = 3
XID_CHECKPOINT_INTERVAL = 1024

# FSM geometry (freespace.c, fsm_internals.h) for 8 KiB pages
SLOTS_PER_FSM_PAGE = (XLOG_BLCKSZ - 24 - 4) - (XLOG_BLCKSZ // 2 - 1)
FSM_TREE_DEPTH = 3

_RM_XLOG = int(RmgrId.XLOG)
_PAGE_MASK = XLOG_BLCKSZ - 1
# the fused path's per-record unpack: the XLogRecord header, then the 22 bytes that are block
# 0's header and the main data's header in the simple layout (SIMPLE_RECORD's tail)
_FUSED_HEAD = struct.Struct(XLOG_RECORD_HEADER.format + f"{SIMPLE_HEADERS.size}s")
_SIMPLE_LAYOUT = SIMPLE_HEADERS
_RM_XACT = int(RmgrId.XACT)
_RM_SMGR = int(RmgrId.SMGR)
_RM_CLOG = int(RmgrId.CLOG)
_RM_DBASE = int(RmgrId.DBASE)
_RM_TBLSPC = int(RmgrId.TBLSPC)
_RM_COMMIT_TS = int(RmgrId.COMMIT_TS)
_PARAMETER_CHANGE = struct.Struct("<6i??")  # xl_parameter_change
_COMMIT_TS_TRUNCATE = struct.Struct("<iI")  # pageno, oldestXid
_RM_MULTIXACT = int(RmgrId.MULTIXACT)
_RM_RELMAP = int(RmgrId.RELMAP)
_RM_HEAP2 = int(RmgrId.HEAP2)
_RM_HEAP = int(RmgrId.HEAP)

# Resource managers whose records only change the pages they reference (no metadata); Heap
# and Heap2 also clear VM bits, which _may_clear_vm detects.
_FAST_RMGRS = frozenset(
    int(r)
    for r in (
        RmgrId.HEAP2, RmgrId.HEAP, RmgrId.BTREE, RmgrId.HASH, RmgrId.GIN, RmgrId.GIST,
        RmgrId.SEQ, RmgrId.SPGIST, RmgrId.BRIN, RmgrId.GENERIC,
    )
)
_HEAP_FLAGS_AT_7 = frozenset((0x10, 0x20, 0x40, 0x60))  # DELETE, UPDATE, HOT_UPDATE, LOCK

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_SMGR_CREATE = struct.Struct("<IIIi")  # spc, db, rel, fork
_SMGR_TRUNCATE = struct.Struct("<IIIIi")  # blkno, spc, db, rel, flags
_DBASE_COPY = struct.Struct("<IIII")  # db, spc, src db, src spc
_DBASE_WAL_LOG = struct.Struct("<II")  # db, spc
_DBASE_DROP = struct.Struct("<Ii")  # db, ntablespaces
_RELMAP_UPDATE = struct.Struct("<IIi")  # db, spc, nbytes
_CLOG_TRUNCATE = struct.Struct("<iII")  # pageno, oldestXact, oldestXactDb
_MX_CREATE = struct.Struct("<IIi")  # mid, moff, nmembers
_MX_MEMBER = struct.Struct("<Ii")  # xid, status
_MX_TRUNCATE = struct.Struct("<IIIII")  # oldestMultiDB, startOff, endOff, startMemb, endMemb
_PD_UPPER = struct.Struct("<H")
_REL_SIZE = struct.Struct("<I")  # a relation size value, as DatadirModification stores it
# encode_postgres_record(will_init, raw) == _PG_RECORD_HEADS[will_init] + raw
_PG_RECORD_HEADS = (encode_postgres_record(False, b""), encode_postgres_record(True, b""))
_PD_LSN = struct.Struct("<II")


# Runs of like records (``_same_run``, the ingest kernel ``protocol.wal.ingest_kernel.same_run``):
# a record taken by the fused path through the "same as the one before" shortcut is checked
# together with up to the rest of its page's records when at least this many more could follow
# on the page.
_RUN_MIN = 4
# (module globals, so that tests can count their calls)
_same_run = same_run
_fused_walk = fused_walk
# relation forks the walk kernel is told about (the ones the fused path met last)
_WALK_RELS_MAX = 16


# 1 GiB of zero pages: far beyond any bulk extension PostgreSQL does without WAL.
MAX_ZERO_FILL_BLOCKS = 131072

def _bad(rec: DecodedRecord, what: str) -> RemoteProtocolError:
    return RemoteProtocolError(
        f"{rec.rmgr_name}/{rec.record_type} at {format_lsn(rec.lsn)}: {what}", sqlstate=DATA_CORRUPTED
    )


def _unpack(st: struct.Struct, rec: DecodedRecord, what: str) -> tuple[int, ...]:
    if len(rec.main_data) < st.size:
        raise _bad(rec, f"{what} needs {st.size} bytes of main data, got {len(rec.main_data)}")
    return st.unpack_from(rec.main_data)


# --- xid arithmetic (transam.h) ---------------------------------------------------------------


def xid_precedes(a: int, b: int) -> bool:
    if a < FIRST_NORMAL_XID or b < FIRST_NORMAL_XID:
        return a < b
    return ((a - b) & 0xFFFF_FFFF) >= 0x8000_0000


def xid_follows_or_equals(a: int, b: int) -> bool:
    return not xid_precedes(a, b)


def clog_page_precedes(page1: int, page2: int) -> bool:
    xid1 = (page1 * CLOG_XACTS_PER_PAGE + FIRST_NORMAL_XID + 1) & 0xFFFF_FFFF
    xid2 = (page2 * CLOG_XACTS_PER_PAGE + FIRST_NORMAL_XID + 1) & 0xFFFF_FFFF
    return xid_precedes(xid1, xid2) and xid_precedes(
        xid1, (xid2 + CLOG_XACTS_PER_PAGE - 1) & 0xFFFF_FFFF
    )


def fsm_logical_to_physical(logpageno: int) -> int:
    """Block of the bottom-level FSM page ``logpageno`` (freespace.c, level 0)."""
    leafno = logpageno
    pages = 0
    for _ in range(FSM_TREE_DEPTH):
        pages += leafno + 1
        leafno //= SLOTS_PER_FSM_PAGE
    return pages - 1


def _raw_will_init(blk: BlockRef) -> bool:
    """``blk.will_init or blk.apply_image`` (whether redo starts from nothing), without the
    property calls."""
    flags = blk.fork_flags
    return bool(flags & BKPBLOCK_WILL_INIT) or (
        bool(flags & BKPBLOCK_HAS_IMAGE) and bool(blk.bimg_info & BKPIMAGE_APPLY)
    )


def _may_clear_vm(rec: DecodedRecord) -> bool:
    """Whether a Heap/Heap2 record's flags may clear visibility-map bits (then ``vm_clears``
    says exactly which); conservative: a short main data also answers yes."""
    return _may_clear_vm_main(rec.xl_rmid, rec.xl_info, rec.main_data)


def _may_clear_vm_main(rmid: int, info: int, main: bytes) -> bool:
    """``_may_clear_vm`` from the record's header fields and main data."""
    op = info & 0x70
    if rmid == _RM_HEAP:
        if op == 0x00:  # INSERT: xl_heap_insert.flags
            return len(main) < 3 or bool(main[2] & 0x01)
        if op in _HEAP_FLAGS_AT_7:
            return len(main) < 8 or bool(main[7] & 0x03)
        return False
    if op == 0x50:  # MULTI_INSERT: xl_heap_multi_insert.flags
        return not main or bool(main[0] & 0x01)
    if op == 0x60:  # LOCK_UPDATED
        return len(main) < 8 or bool(main[7] & 0x01)
    return False


# --- XACT records ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class ParsedXact:
    xact_time: int
    xinfo: int
    subxacts: tuple[int, ...]
    rels: tuple[tuple[int, int, int], ...]
    twophase_xid: int | None


def parse_xact(rec: DecodedRecord) -> ParsedXact:
    """xl_xact_commit / xl_xact_abort with the parts ``xinfo`` announces (xactdesc.c order)."""
    buf = rec.main_data
    n = len(buf)
    pos = 8
    if n < 8:
        raise _bad(rec, "truncated xact record")
    (xact_time,) = _I64.unpack_from(buf)
    xinfo = 0
    if rec.xl_info & XLOG_XACT_HAS_INFO:
        if n < pos + 4:
            raise _bad(rec, "truncated xinfo")
        (xinfo,) = _U32.unpack_from(buf, pos)
        pos += 4

    def count(size: int, what: str) -> int:
        nonlocal pos
        if n < pos + 4:
            raise _bad(rec, f"truncated {what} count")
        (c,) = _I32.unpack_from(buf, pos)
        pos += 4
        if c < 0 or n < pos + c * size:
            raise _bad(rec, f"{what} run past the record")
        return int(c)

    if xinfo & XACT_XINFO_HAS_DBINFO:
        pos += 8
    subxacts: tuple[int, ...] = ()
    if xinfo & XACT_XINFO_HAS_SUBXACTS:
        c = count(4, "subxacts")
        subxacts = struct.unpack_from(f"<{c}I", buf, pos)
        pos += 4 * c
    rels: tuple[tuple[int, int, int], ...] = ()
    if xinfo & XACT_XINFO_HAS_RELFILENODES:
        c = count(12, "relfilenodes")
        flat = struct.unpack_from(f"<{3 * c}I", buf, pos)
        rels = tuple((flat[i], flat[i + 1], flat[i + 2]) for i in range(0, 3 * c, 3))
        pos += 12 * c
    if xinfo & XACT_XINFO_HAS_DROPPED_STATS:
        c = count(12, "dropped stats")
        pos += 12 * c
    op = rec.xl_info & XLOG_XACT_OPMASK
    if xinfo & XACT_XINFO_HAS_INVALS and op in (XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED):
        c = count(16, "invalidations")
        pos += 16 * c
    twophase_xid = None
    if xinfo & XACT_XINFO_HAS_TWOPHASE:
        if n < pos + 4:
            raise _bad(rec, "truncated two-phase xid")
        (twophase_xid,) = _U32.unpack_from(buf, pos)
    if pos > n:
        raise _bad(rec, "xact record parts run past the record")
    return ParsedXact(xact_time, xinfo, subxacts, rels, twophase_xid)


# --- the ingest --------------------------------------------------------------------------------


@attrs.define
class IngestStats:
    records: int = 0
    skipped: int = 0
    values: int = 0
    images: int = 0
    wal_records: int = 0


class WalIngest:
    """Turns decoded records into values on one timeline (the timeline's only writer)."""

    def __init__(self, timeline: Timeline, writer: DatadirWriter | None = None) -> None:
        self.tl = timeline
        self.w = writer if writer is not None else DatadirWriter(timeline)
        self.stats = IngestStats()
        # track_commit_timestamp as the stored pg_control says (PARAMETER_CHANGE updates it);
        # None until first needed
        self._commit_ts_on: bool | None = None
        # (start, end) of the last record seen, applied or skipped: a basebackup at
        # last_record_lsn gives its checkpoint record this xl_prev.
        self.last_record: tuple[Lsn, Lsn] | None = None
        # the relation forks the fused walk kernel (``_fused_walk``) met last, newest last
        self._walk_rels: list[RelKey] = []

    async def ingest_records(self, recs: Sequence[DecodedRecord]) -> None:
        """Ingest ``recs`` in order: the same values as ``ingest_record`` on each of them
        (records already in are skipped), for less CPU per record. The common record
        (``_fast_path``'s kind: one raw record per block, no metadata) costs no coroutine
        call: its values are collected and stored together (``Timeline.put_mixed_nowait``:
        one buffer append for many values) before the next record that needs the general
        path, and at the end; ``last_record_lsn`` advances before every await and at the end
        instead of after every record. Nobody can tell the difference: trio switches tasks
        only at an await, and at each of them every record whose values are stored is
        finished (readers and flushes see whole records; a layer rolls only between two
        LSNs), and a waiter for an LSN inside the batch is woken at the latest at its end.
        On an error, the records stored before the failing one stay finished, as with
        ``ingest_record`` one by one."""
        if not recs:
            return
        tl = self.tl
        w = self.w
        stats = self.stats
        sizes = w.rel_sizes
        slow_ingest = self.ingest_record
        heads = _PG_RECORD_HEADS
        last = tl.last_record_lsn  # end of the last record taken (stored or to be stored)
        last_start = Lsn(0)  # and its start
        items: list[tuple[Key, Lsn, bytes, bool]] = []
        add = items.append
        nxt = -1  # nextXid while the checkpoint cannot change (-1: look it up)
        # The block a fast record referenced last, known to be inside its fork, and its key
        # (a bulk load fills one page with many records in a row).
        last_rnode: RelFileNode | None = None
        last_fork = last_blkno = -1
        last_key = Key(b"")
        n_fast = n_values = 0
        for rec in recs:
            end = rec.end_lsn
            rmid = rec.xl_rmid
            blocks = rec.blocks
            fast = end > last and rmid in _FAST_RMGRS
            if fast:
                xid = rec.xl_xid
                if xid:
                    if nxt < 0:
                        cp = w.checkpoint
                        nxt = -1 if cp is None else cp.next_xid & 0xFFFF_FFFF
                    # _fast_path's xid test: the xid is below nextXid (else nextXid advances)
                    if nxt < 0:
                        fast = False
                    elif xid >= FIRST_NORMAL_XID and nxt >= FIRST_NORMAL_XID:
                        fast = ((xid - nxt) & 0xFFFF_FFFF) >= 0x8000_0000
                    else:
                        fast = xid < nxt
                if fast and rmid <= _RM_HEAP:
                    if rmid == _RM_HEAP and rec.xl_info & 0x70 == 0:
                        main = rec.main_data  # _may_clear_vm for the commonest record: INSERT
                        fast = len(main) >= 3 and not main[2] & 0x01
                    else:
                        fast = not _may_clear_vm(rec)
            if fast:
                # One raw record per block, if every block is inside its fork, or the record's
                # only block is the one just past the end (a bulk load's new heap page: the
                # general path would store the same two values, the record and the new size);
                # any other block sends the record to the general path (its values taken back
                # first).
                mark = len(items)
                raw = rec.raw
                grown: RelKey | None = None
                for blk in blocks:
                    rnode = blk.rnode
                    forknum = blk.forknum
                    blkno = blk.blkno
                    if rnode is not last_rnode or blkno != last_blkno or forknum != last_fork:
                        rel = (rnode.spc, rnode.db, rnode.rel, forknum)
                        n = sizes.get(rel)
                        if n is None or blkno >= n or forknum > INIT_FORKNUM:
                            if blkno != n or len(blocks) != 1 or forknum > INIT_FORKNUM:
                                fast = False
                                break
                            grown = rel
                        last_rnode, last_fork, last_blkno = rnode, forknum, blkno
                        last_key = rel_block_key(rnode.spc, rnode.db, rnode.rel, forknum, blkno)
                    flags = blk.fork_flags
                    will_init = flags & BKPBLOCK_WILL_INIT != 0 or (
                        flags & BKPBLOCK_HAS_IMAGE != 0 and blk.bimg_info & BKPIMAGE_APPLY != 0
                    )
                    add((last_key, end, heads[will_init] + raw, will_init))
                if not fast:
                    del items[mark:]
                elif grown is not None:
                    size = last_blkno + 1
                    add((rel_size_key(*grown), end, encode_value(Image(_REL_SIZE.pack(size))), True))
                    sizes[grown] = size
            if not fast:
                if items:
                    await self._store(items)
                    items.clear()
                if last > tl.last_record_lsn:
                    tl.finish_write(last)
                    self.last_record = (last_start, last)
                await slow_ingest(rec)
                last = tl.last_record_lsn
                nxt = -1
                last_rnode = None  # sizes may have changed
                continue
            last = end
            last_start = rec.lsn
            n_fast += 1
            n_values += len(blocks)
        stats.records += n_fast
        stats.values += n_values
        stats.wal_records += n_values
        if items:
            await self._store(items)
        if last > tl.last_record_lsn:
            tl.finish_write(last)
        final = recs[-1]
        self.last_record = (final.lsn, final.end_lsn)

    async def ingest_decoder(self, dec: WalStreamDecoder) -> tuple[int, Lsn, NeedData | EndOfWal]:
        """Decode and ingest every record ``dec`` can give from the bytes fed so far, in LSN
        order; returns (records taken, end LSN of the last one or 0, what stopped the
        decoder). The same values, statistics and ``last_record_lsn`` as ``decode_into``
        followed by ``ingest_records``, for less CPU: the fused path.

        The commonest records -- one block reference (block id 0) without image, a short
        main data, of a resource manager that only changes its pages (``_FAST_RMGRS``; a heap
        record only when its flags clear no VM bit), an xid below nextXid, the block inside
        its fork or the only block just past the fork's end, starting and ending inside one
        page -- are recognised from the bytes (``in_page_cursor``) after the decoder's checks
        of ``decode_into`` (``xl_prev`` link, length, resource manager, CRC-32C), and their
        value (the raw record under the block's key, plus the new fork size when it grows)
        is collected without building a ``DecodedRecord`` or ``BlockRef``. Every other
        record -- anything that fails a test, a page header next, a record over pages --
        comes from ``dec.next_record()`` (which checks it again and reports the end of WAL
        exactly as before) and goes, with the records after it up to the next fused one,
        through ``ingest_records``, after the fused values collected so far are stored and
        finished (a record ``next_record`` gave whole that is of the fused kind, such as a bulk
        load's record crossing into the next page, is collected like a fused one:
        ``_fused_whole``). Records like the one just taken that follow it on the page are
        checked together (``_same_run``) and collected as one run item, stored with the values
        by ``_store``. ``last_record_lsn`` advances as in ``ingest_records``: before
        every await, at the end, and only over records whose values are all stored."""
        tl = self.tl
        w = self.w
        sizes = w.rel_sizes
        stats = self.stats
        heads = _PG_RECORD_HEADS
        fast_rmgrs = _FAST_RMGRS
        crc32c = _crcmod.crc32c
        unpack_head = _FUSED_HEAD.unpack_from
        unpack_layout = _SIMPLE_LAYOUT.unpack
        payload_at = SIMPLE_PAYLOAD_AT
        not_simple = BKPBLOCK_HAS_IMAGE | BKPBLOCK_SAME_REL
        # values (key, end, value, will_init) and runs of like records (key, ends, head, raws,
        # will_init), in LSN order (Timeline.put_mixed_nowait)
        items: list[PutItem] = []
        add: Callable[..., None] = items.append  # (end is a plain int here)
        slow: list[DecodedRecord] = []
        last: int = tl.last_record_lsn  # end of the last record taken
        last_start = 0
        taken = n_fast = 0
        nxt = -1  # nextXid while the checkpoint cannot change (-1: look it up)
        # what the last fused record had: its layout bytes (block 0's header: block, sizes,
        # main data length), xl_tot_len, xl_info, xl_rmid; its key, value head, will_init
        same_sig = b""
        same_len = same_info = same_rmid = vm_at = -1
        key = Key(b"")
        head = b""
        will_init = False
        blkno = 0
        xid_ok = -1  # an xid that passed the nextXid test (while nxt holds)
        stop: NeedData | EndOfWal
        walk_rels = self._walk_rels
        while True:
            pending = False  # a fused record waits for the slow records before it
            at_end = False  # the in-page walk stopped at the page's (or the input's) end
            cursor = dec.in_page_cursor()
            if (
                cursor is not None
                and not slow
                and 0 <= cursor[2] - cursor[1] <= len(cursor[0])
                and (state := dec.walk_state()) is not None
            ):
                # The walk kernel first: every record of the fused kind from here, across
                # pages, as packed runs (``fused_walk``); the loop below takes what it refuses.
                if nxt < 0:
                    cp = w.checkpoint
                    nxt = -1 if cp is None else cp.next_xid & 0xFFFF_FFFF
                buf, base, pos, prev = cursor
                assert prev is not None  # (walk_state)
                seg_size, latest_page, tli = state
                walked = 0
                while True:
                    table = [(*r, n) for r in walk_rels if (n := sizes.get(r)) is not None]
                    pos, prev, latest_page, k, kitems, ksizes, why, want = _fused_walk(
                        buf, base, pos, prev, latest_page, tli, seg_size, table, nxt, last
                    )
                    if k:
                        walked += k
                        items += cast("list[PutItem]", kitems)  # (its keys are storage keys)
                        for r, nb in zip(table, ksizes, strict=True):
                            if nb != r[4]:
                                sizes[r[:4]] = nb
                        last, last_start = pos, prev
                    if why == WALK_REL and want is not None and want not in walk_rels and want in sizes:
                        if len(walk_rels) >= _WALK_RELS_MAX:
                            del walk_rels[0]
                        walk_rels.append(want)
                        continue
                    break
                if walked:
                    dec.advance_walk(pos, prev, latest_page)
                    taken += walked
                    stats.records += walked
                    stats.values += walked
                    stats.wal_records += walked
                    same_sig = b""
                    cursor = dec.in_page_cursor()
            if cursor is not None:
                buf, base, pos, prev = cursor
                first = pos
                # records start at or below ``limit`` (a page header is never read: the loop
                # stops at the page's end) and end at or below ``bound`` (the page's and the
                # input's end)
                bound = min((pos | _PAGE_MASK) + 1, base + len(buf))
                limit = bound - payload_at if pos & _PAGE_MASK else -1
                while pos <= limit:
                    o = pos - base
                    tot_len, xid, xprev, info, rmid, crc, sig = unpack_head(buf, o)
                    # decode_into's checks (prev None: never equal)
                    if xprev != prev:
                        break
                    if pos + tot_len > bound:
                        at_end = True
                        break
                    if sig != same_sig or tot_len != same_len or info != same_info or rmid != same_rmid:
                        # not the layout and block of the fused record just before: every test
                        (
                            block_id, flags, data_len, spc, db, rel, blkno, main_id, main_len
                        ) = unpack_layout(sig)
                        if (
                            rmid not in fast_rmgrs
                            or block_id != 0
                            or main_id != XLR_BLOCK_ID_DATA_SHORT
                            or flags & not_simple
                            or payload_at + data_len + main_len != tot_len
                            or (data_len != 0) != (flags & BKPBLOCK_HAS_DATA != 0)
                        ):
                            break
                        if slow:
                            pending = True  # the tests below depend on the slow records
                            break
                        end = (pos + tot_len + 7) & ~7
                        if end <= last:
                            break  # already in: ingest_records counts it as skipped
                        vm_at = 0  # where the heap INSERT's flags byte is (0: no VM test)
                        if rmid <= _RM_HEAP:
                            main_at = payload_at + data_len
                            if rmid == _RM_HEAP and info & 0x70 == 0:  # INSERT: flags at 2
                                if main_len < 3:
                                    break
                                vm_at = main_at + 2
                            elif _may_clear_vm_main(rmid, info, buf[o + main_at : o + tot_len]):
                                break
                            else:
                                vm_at = -1  # decided for this record only
                        fork = flags & BKPBLOCK_FORK_MASK
                        if fork > INIT_FORKNUM:
                            break  # the general path refuses it
                        grown = None
                        relkey = (spc, db, rel, fork)
                        n = sizes.get(relkey)
                        if n is None or blkno >= n:
                            if blkno != n:
                                break
                            grown = relkey
                        key = rel_block_key(spc, db, rel, fork, blkno)
                        will_init = flags & BKPBLOCK_WILL_INIT != 0
                        head = heads[will_init]
                        # the next record with this layout, block, length and header can
                        # skip these tests (the block is inside its fork from now on)
                        if vm_at >= 0:
                            same_sig, same_len, same_info, same_rmid = sig, tot_len, info, rmid
                        else:
                            same_sig = b""
                    else:
                        end = (pos + tot_len + 7) & ~7  # (above last: the record before was)
                        grown = None
                    if vm_at > 0 and buf[o + vm_at] & 0x01:
                        break
                    if xid != xid_ok:
                        if xid:
                            if nxt < 0:
                                cp = w.checkpoint
                                if cp is None:
                                    break
                                nxt = cp.next_xid & 0xFFFF_FFFF
                            if xid >= FIRST_NORMAL_XID and nxt >= FIRST_NORMAL_XID:
                                if ((xid - nxt) & 0xFFFF_FFFF) < 0x8000_0000:
                                    break
                            elif xid >= nxt:
                                break
                        xid_ok = xid
                    stride = end - pos
                    m = 0  # like records after this one, taken with it as one run
                    raw = buf[o : o + tot_len]
                    if crc32c(raw[:20], crc32c(raw[SIZE_OF_XLOG_RECORD:])) != crc:
                        break  # next_record reports it
                    if (
                        grown is None
                        and vm_at >= 0
                        and (k := (bound - end - tot_len) // stride + 1) >= _RUN_MIN
                        and buf[end - base + SIZE_OF_XLOG_RECORD : end - base + payload_at] == sig
                    ):
                        # like records after this one (a bulk load's INSERTs into one heap
                        # page): checked together, collected as one run (no value per record)
                        m, raws = _same_run(buf, o, pos, tot_len, stride, k, vm_at)
                    if m:
                        top = end + m * stride
                        add((key, range(end, top + 1, stride), head, raws, will_init))
                        last_start = prev = pos + m * stride
                        last = pos = top
                        n_fast += m + 1
                        continue
                    add((key, end, head + raw, will_init))
                    if grown is not None:
                        size = blkno + 1
                        add((rel_size_key(*grown), end, encode_value(Image(_REL_SIZE.pack(size))), True))
                        sizes[grown] = size
                    last_start = prev = pos
                    last = pos = end
                    n_fast += 1
                else:
                    at_end = True
                same_sig = b""  # the next record goes through every test
                if pos != first:
                    assert prev is not None
                    dec.advance_in_page(pos, prev)
                    taken += n_fast
                    stats.records += n_fast
                    stats.values += n_fast
                    stats.wal_records += n_fast
                    n_fast = 0
            if not pending:
                if at_end and not slow:
                    # the record crossing into the next page, from the decoder's bytes
                    cross = dec.crossing_record()
                    if cross is not None and self._fused_crossing(*cross, last, add):
                        dec.take_crossing()
                        last_start, last = cross[1], cross[2]
                        taken += 1
                        stats.records += 1
                        stats.values += 1
                        stats.wal_records += 1
                        continue
                item = dec.next_record()
                if isinstance(item, DecodedRecord):
                    taken += 1
                    if not slow and item.xl_rmid in fast_rmgrs and self._fused_whole(item, last, add):
                        # (a bulk load's record crossing into the next page)
                        last_start, last = item.lsn, item.end_lsn
                        stats.records += 1
                        stats.values += 1
                        stats.wal_records += 1
                        continue
                    slow.append(item)
                    continue
                stop = item
            # store the fused values, finish their records, then the slow records
            if items:
                await self._store(items)
                items.clear()
            if last > tl.last_record_lsn:
                tl.finish_write(Lsn(last))
                self.last_record = (Lsn(last_start), Lsn(last))
            if slow:
                await self.ingest_records(slow)
                slow = []
                last = tl.last_record_lsn
                nxt = xid_ok = -1
            if not pending:
                end_lsn = self.last_record[1] if taken and self.last_record is not None else 0
                return taken, Lsn(end_lsn), stop

    def _fused_whole(self, rec: DecodedRecord, last: int, add: Callable[..., None]) -> bool:
        """The fused path for a record the decoder gave whole (``next_record``: one that
        crosses pages and that ``crossing_record`` did not give, already checked there): if
        it has one block, ``_fused_one`` decides."""
        blocks = rec.blocks
        if len(blocks) != 1:
            return False
        blk = blocks[0]
        rnode = blk.rnode
        return self._fused_one(
            rec.end_lsn, rec.xl_rmid, rec.xl_info, rec.xl_xid, rec.main_data, rnode.spc,
            rnode.db, rnode.rel, blk.fork_flags, blk.blkno, rec.raw, last, add,
        )

    def _fused_crossing(
        self, raw: bytes, lsn: int, end: int, prev: int, last: int, add: Callable[..., None]
    ) -> bool:
        """The fused path for the record crossing into the next page that the decoder gave
        as bytes (``WalStreamDecoder.crossing_record``, which checked the page header between
        its pieces): the checks of an in-page fused record -- ``xl_prev`` equal to ``prev``,
        the simple layout (so the body decodes, as ``decode_body`` would parse it), CRC-32C --
        then ``_fused_one``. ``False``: nothing changed, ``next_record`` reads it."""
        if len(raw) < SIMPLE_PAYLOAD_AT:
            return False
        (
            tot_len, xid, xprev, info, rmid, crc,
            block_id, flags, data_len, spc, db, rel, blkno, main_id, main_len,
        ) = SIMPLE_RECORD.unpack_from(raw)
        if (
            xprev != prev
            or block_id != 0
            or main_id != XLR_BLOCK_ID_DATA_SHORT
            or flags & (BKPBLOCK_HAS_IMAGE | BKPBLOCK_SAME_REL)
            or SIMPLE_PAYLOAD_AT + data_len + main_len != tot_len
            or tot_len != len(raw)
            or (data_len != 0) != (flags & BKPBLOCK_HAS_DATA != 0)
        ):
            return False
        crc32c = _crcmod.crc32c
        if crc32c(raw[:20], crc32c(raw[SIZE_OF_XLOG_RECORD:])) != crc:
            return False
        main = raw[SIMPLE_PAYLOAD_AT + data_len :]
        return self._fused_one(end, rmid, info, xid, main, spc, db, rel, flags, blkno, raw, last, add)

    def _fused_one(
        self,
        end: int,
        rmid: int,
        info: int,
        xid: int,
        main: bytes,
        spc: int,
        db: int,
        rel: int,
        flags: int,
        blkno: int,
        raw: bytes,
        last: int,
        add: Callable[..., None],
    ) -> bool:
        """A checked record with one block and no image (``raw``; its block's relation,
        fork flags and number; its main data), taken outside the in-page loop: if it is of
        the fused kind -- ending above ``last``, a fork up to INIT, a resource manager of
        ``_FAST_RMGRS`` clearing no VM bit, an xid below nextXid, the block inside its fork
        or the one just past its end -- ``add`` its values as ``ingest_records`` would
        collect them (the raw record under the block's key, and the new size) and say
        ``True``; else change nothing. Saves the batch call for one record."""
        forknum = flags & BKPBLOCK_FORK_MASK
        if end <= last or rmid not in _FAST_RMGRS or flags & BKPBLOCK_HAS_IMAGE or forknum > INIT_FORKNUM:
            return False
        if xid:
            cp = self.w.checkpoint
            if cp is None:
                return False
            nxt = cp.next_xid & 0xFFFF_FFFF
            if xid >= FIRST_NORMAL_XID and nxt >= FIRST_NORMAL_XID:
                if ((xid - nxt) & 0xFFFF_FFFF) < 0x8000_0000:
                    return False
            elif xid >= nxt:
                return False
        if rmid <= _RM_HEAP and _may_clear_vm_main(rmid, info, main):
            return False
        relkey = (spc, db, rel, forknum)
        sizes = self.w.rel_sizes
        n = sizes.get(relkey)
        grown = n is None or blkno >= n
        if grown and blkno != n:
            return False
        will_init = flags & BKPBLOCK_WILL_INIT != 0
        key = rel_block_key(spc, db, rel, forknum, blkno)
        add((key, end, _PG_RECORD_HEADS[will_init] + raw, will_init))
        if grown:
            add((rel_size_key(*relkey), end, encode_value(Image(_REL_SIZE.pack(blkno + 1))), True))
            sizes[relkey] = blkno + 1
        return True

    async def _store(self, items: Sequence[PutItem]) -> None:
        """Store the values collected by ``ingest_records`` (single values) or the fused path
        (also runs of like records: one value per record, ``head + raws[v]`` at ``lsns[v]``):
        as many at a time as the write buffer takes (``Timeline.put_mixed_nowait``), the one it
        does not take the slow way (``put_encoded`` rolls the layer or hands the full buffer
        over). Before that await, the records whose values are all stored are finished."""
        tl = self.tl
        put_mixed = tl.put_mixed_nowait
        n = len(items)
        i, v = put_mixed(items, 0, 0)
        while i < n:
            item = items[i]
            if len(item) == 4:
                key, lsn, blob, will_init = item
                nxt = (i + 1, 0)
            elif len(item) == 6:
                key, ends, packed, first, vlen, will_init = item
                lsn = ends[v]
                blob = packed[first + v * vlen : first + (v + 1) * vlen]
                nxt = (i, v + 1) if v + 1 < len(ends) else (i + 1, 0)
            else:
                key, lsns, head, raws, will_init = item
                lsn, blob = lsns[v], head + raws[v]
                nxt = (i, v + 1) if v + 1 < len(raws) else (i + 1, 0)
            # the end of the last record whose values are all stored
            done = item[1][v - 1] if len(item) != 4 and v else 0
            j = i - 1
            while not done and j >= 0:
                prior = items[j]
                end = prior[1] if len(prior) == 4 else prior[1][-1]
                if end != lsn:  # (else the record at ``lsn`` is partly stored)
                    done = end
                j -= 1
            if done > tl.last_record_lsn:
                tl.finish_write(Lsn(done))
            await tl.put_encoded(key, Lsn(lsn), blob, will_init)
            i, v = put_mixed(items, *nxt)

    async def ingest_record(self, rec: DecodedRecord) -> bool:
        """Ingest one record; ``False`` if it was already in (end LSN <= last_record_lsn)."""
        end = rec.end_lsn
        tl = self.tl
        self.last_record = (rec.lsn, end)
        if end <= tl.last_record_lsn:
            self.stats.skipped += 1
            return False
        if rec.xl_rmid in _FAST_RMGRS:
            done = self._fast_path(rec, end)
            if done >= 0:
                blocks = rec.blocks
                if done < len(blocks):
                    await self._put_raw(blocks[done:], end, rec.raw)
                tl.finish_write(end)
                stats = self.stats
                stats.records += 1
                stats.values += len(blocks)
                stats.wal_records += len(blocks)
                return True
        mod = self.w.begin(end)
        await self._ingest(rec, mod)
        await mod.commit()
        self.stats.records += 1
        self.stats.values += mod.values
        return True

    def _fast_path(self, rec: DecodedRecord, end: Lsn) -> int:
        """The bulk of the WAL (heap, btree... records touching pages inside their forks, with
        an xid below nextXid and no VM bits to clear) needs no metadata change: one raw record
        per block. Synchronous, so the common record costs no coroutine: returns -1 (not such
        a record, nothing written) or how many blocks were stored; ``ingest_record`` puts the
        rest (when ``put_nowait`` declined: a roll, a full write buffer) and finishes."""
        w = self.w
        xid = rec.xl_xid
        if xid:
            cp = w.checkpoint
            if cp is None:
                return -1
            nxt = cp.next_xid & 0xFFFF_FFFF
            if xid >= FIRST_NORMAL_XID and nxt >= FIRST_NORMAL_XID:
                if ((xid - nxt) & 0xFFFF_FFFF) < 0x8000_0000:
                    return -1  # nextXid advances
            elif xid >= nxt:
                return -1
        if rec.xl_rmid <= _RM_HEAP and _may_clear_vm(rec):
            return -1
        sizes = w.rel_sizes
        blocks = rec.blocks
        for blk in blocks:
            rnode = blk.rnode
            n = sizes.get((rnode.spc, rnode.db, rnode.rel, blk.forknum))
            if n is None or blk.blkno >= n or blk.forknum > INIT_FORKNUM:
                return -1
        put_nowait = self.tl.put_nowait
        raw = rec.raw
        done = 0
        for blk in blocks:
            rnode = blk.rnode
            will_init = _raw_will_init(blk)
            if not put_nowait(
                rel_block_key(rnode.spc, rnode.db, rnode.rel, blk.forknum, blk.blkno),
                end,
                encode_postgres_record(will_init, raw),
                will_init,
            ):
                break
            done += 1
        return done

    async def _put_raw(self, blocks: Sequence[BlockRef], end: Lsn, raw: bytes) -> None:
        for blk in blocks:
            rnode = blk.rnode
            await self.tl.put(
                rel_block_key(rnode.spc, rnode.db, rnode.rel, blk.forknum, blk.blkno),
                end,
                PostgresRecord(_raw_will_init(blk), raw),
            )

    async def _ingest(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        # The decoder takes any 4-bit fork number; PostgreSQL has four forks. Refused before
        # anything is put, so a bad record leaves no value of its other blocks behind.
        for blk in rec.blocks:
            if blk.forknum > INIT_FORKNUM:
                raise _bad(rec, f"block reference {blk.block_id} names fork number {blk.forknum}")
        rmid = rec.xl_rmid
        info = rec.xl_info & 0xF0
        if rec.xl_xid:
            await self._update_next_xid(mod, rec.xl_xid)
        if rmid in (_RM_HEAP, _RM_HEAP2):
            await self._vm_clears(rec, mod)
        elif rmid == _RM_XLOG:
            if info in (XLOG_CHECKPOINT_SHUTDOWN, XLOG_CHECKPOINT_ONLINE):
                await self._checkpoint(rec, mod)
            elif info == XLOG_PARAMETER_CHANGE:
                await self._parameter_change(rec, mod)
            elif info == XLOG_NEXTOID:
                (next_oid,) = _unpack(_U32, rec, "NEXTOID")
                cp = await mod.get_checkpoint()
                mod.put_checkpoint(attrs.evolve(cp, next_oid=next_oid))
        elif rmid == _RM_XACT:
            await self._xact(rec, mod)
        elif rmid == _RM_SMGR:
            if info == XLOG_SMGR_CREATE:
                spc, db, rel, fork = _unpack(_SMGR_CREATE, rec, "Storage/CREATE")
                if not 0 <= fork <= INIT_FORKNUM:
                    raise _bad(rec, f"fork number {fork}")
                await mod.put_rel_creation((spc, db, rel, fork), 0)
            elif info == XLOG_SMGR_TRUNCATE:
                await self._smgr_truncate(rec, mod)
        elif rmid == _RM_DBASE:
            await self._dbase(rec, mod, info)
        elif rmid == _RM_TBLSPC:
            await self._tblspc(rec, mod, info)
        elif rmid == _RM_COMMIT_TS:
            await self._commit_ts(rec, mod, info)
        elif rmid == _RM_RELMAP:
            if info == XLOG_RELMAP_UPDATE:
                db, spc, nbytes = _unpack(_RELMAP_UPDATE, rec, "RelMap/UPDATE")
                data = rec.main_data[_RELMAP_UPDATE.size : _RELMAP_UPDATE.size + nbytes]
                if nbytes < 0 or len(data) != nbytes:
                    raise _bad(rec, f"relmap update of {nbytes} bytes is truncated")
                await mod.put_relmap_file(spc, db, data)
        elif rmid == _RM_CLOG:
            await self._clog(rec, mod, info)
        elif rmid == _RM_MULTIXACT:
            await self._multixact(rec, mod, info)
        for blk in rec.blocks:
            await self._block(rec, blk, mod)

    # -- block references --

    async def _block(self, rec: DecodedRecord, blk: BlockRef, mod: DatadirModification) -> None:
        rnode = blk.rnode
        rel: RelKey = (rnode.spc, rnode.db, rnode.rel, blk.forknum)
        blkno = blk.blkno
        value: Value
        if (
            rec.xl_rmid == _RM_XLOG
            and rec.xl_info & 0xF0 in (XLOG_FPI, XLOG_FPI_FOR_HINT)
            and blk.apply_image
            and not blk.compression
        ):
            page = blk.image
            assert page is not None
            if _PD_UPPER.unpack_from(page, 14)[0] != 0:
                end = rec.end_lsn
                page = _PD_LSN.pack(end >> 32, end & 0xFFFF_FFFF) + page[8:]
            value = Image(page)
            self.stats.images += 1
        else:
            value = PostgresRecord(blk.will_init or blk.apply_image, rec.raw)
            self.stats.wal_records += 1
        nblocks = mod.sizes.get(rel)
        if nblocks is None:
            nblocks = self.w.rel_sizes.get(rel) if not mod.rel_dirs else None
            if nblocks is None:
                nblocks = await mod.get_rel_size(rel)
        if nblocks is None:
            await mod.put_rel_creation(rel, 0)
            nblocks = 0
        if blkno >= nblocks:
            # PostgreSQL extends relations without WAL, so a small gap before a logged block is
            # normal and gets zero pages. A gap beyond MAX_ZERO_FILL_BLOCKS cannot come from a
            # sane compute: one such record would otherwise write terabytes of zero images.
            if blkno - nblocks > MAX_ZERO_FILL_BLOCKS:
                raise _bad(
                    rec,
                    f"block {blkno} of {rel} is {blkno - nblocks} blocks past its end "
                    f"({nblocks} blocks); refusing to zero-fill more than {MAX_ZERO_FILL_BLOCKS}",
                )
            await mod.put_rel_extend(rel, blkno + 1)
            zero = Image(ZERO_PAGE)
            for gap in range(nblocks, blkno):
                await mod.put_rel_page(rel, gap, zero)
        await mod.put(rel_block_key(rnode.spc, rnode.db, rnode.rel, blk.forknum, blkno), value)

    async def _vm_clears(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        clears = vm_clears(rec)
        if not clears:
            return
        b0 = rec.blocks[0]
        vm_rel: RelKey = (b0.rnode.spc, b0.rnode.db, b0.rnode.rel, VISIBILITYMAP_FORKNUM)
        vm_size = await mod.get_rel_size(vm_rel)
        if not vm_size:
            return  # no VM fork (yet): nothing to clear
        by_page: dict[int, list[tuple[int, int]]] = {}
        for heapblk, flags in clears:
            by_page.setdefault(heapblk // HEAPBLOCKS_PER_PAGE, []).append((heapblk, flags))
        for vm_blk, items in by_page.items():
            if vm_blk >= vm_size:
                continue
            flags = items[0][1]
            if len(items) == 2 and items[1][1] == flags:
                value = ClearVisibilityMapFlags(items[1][0], items[0][0], flags)
            elif len(items) == 1:
                value = ClearVisibilityMapFlags(items[0][0], None, flags)
            else:
                raise _bad(rec, f"unexpected VM clears {items}")
            await mod.put_rel_page(vm_rel, vm_blk, value)

    # -- storage manager --

    async def _smgr_truncate(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        blkno, spc, db, relnode, flags = _unpack(_SMGR_TRUNCATE, rec, "Storage/TRUNCATE")
        if flags & SMGR_TRUNCATE_HEAP:
            rel: RelKey = (spc, db, relnode, MAIN_FORKNUM)
            n = await mod.get_rel_size(rel)
            if n is not None and n > blkno:
                await mod.put_rel_truncation(rel, blkno)
        if flags & SMGR_TRUNCATE_FSM:
            fsm: RelKey = (spc, db, relnode, FSM_FORKNUM)
            n = await mod.get_rel_size(fsm)
            if n is not None:
                phys = fsm_logical_to_physical(blkno // SLOTS_PER_FSM_PAGE)
                if blkno % SLOTS_PER_FSM_PAGE:
                    if phys < n:
                        await mod.put_rel_page(fsm, phys, Image(ZERO_PAGE))
                    phys += 1
                if n > phys:
                    await mod.put_rel_truncation(fsm, phys)
        if flags & SMGR_TRUNCATE_VM:
            vm: RelKey = (spc, db, relnode, VISIBILITYMAP_FORKNUM)
            n = await mod.get_rel_size(vm)
            if n is not None:
                vm_page = blkno // HEAPBLOCKS_PER_PAGE
                rest = blkno % HEAPBLOCKS_PER_PAGE
                if rest:
                    if vm_page < n:
                        await mod.put_rel_page(
                            vm, vm_page, TruncateVisibilityMap(rest // 4, (rest % 4) * 2)
                        )
                    vm_page += 1
                if n > vm_page:
                    await mod.put_rel_truncation(vm, vm_page)

    # -- databases --

    async def _dbase(self, rec: DecodedRecord, mod: DatadirModification, info: int) -> None:
        if info == XLOG_DBASE_CREATE_WAL_LOG:
            db, spc = _unpack(_DBASE_WAL_LOG, rec, "Database/CREATE_WAL_LOG")
            await mod.put_dbdir_creation(spc, db)
        elif info == XLOG_DBASE_CREATE_FILE_COPY:
            db, spc, src_db, src_spc = _unpack(_DBASE_COPY, rec, "Database/CREATE_FILE_COPY")
            await self._copy_database(mod, src_spc, src_db, spc, db)
        elif info == XLOG_DBASE_DROP:
            db, n = _unpack(_DBASE_DROP, rec, "Database/DROP")
            if n < 0 or len(rec.main_data) < _DBASE_DROP.size + 4 * n:
                raise _bad(rec, f"{n} tablespaces run past the record")
            for spc in struct.unpack_from(f"<{n}I", rec.main_data, _DBASE_DROP.size):
                await mod.drop_dbdir(spc, db)

    async def _tblspc(self, rec: DecodedRecord, mod: DatadirModification, info: int) -> None:
        """CREATE / DROP TABLESPACE. The database directory holds ``(spc, 0)`` for a tablespace
        (as ``(1664, 0)`` stands for ``global/``), so an empty one is in a basebackup too; its
        databases' directories ``(spc, db)`` come with their first relation or CREATE DATABASE."""
        (spc,) = _unpack(_U32, rec, "Tablespace/CREATE" if info == XLOG_TBLSPC_CREATE else "Tablespace/DROP")
        if spc in (DEFAULTTABLESPACE_OID, GLOBALTABLESPACE_OID):
            raise _bad(rec, f"tablespace record for the built-in tablespace {spc}")
        if info == XLOG_TBLSPC_CREATE:
            await mod.put_dbdir_creation(spc, 0)
        elif info == XLOG_TBLSPC_DROP:
            # PostgreSQL drops only an empty tablespace; what a database left there goes too.
            for tsp, db in sorted(await mod.list_dbdirs()):
                if tsp == spc:
                    await mod.drop_dbdir(tsp, db)

    async def _copy_database(
        self, mod: DatadirModification, src_spc: int, src_db: int, spc: int, db: int
    ) -> None:
        """CREATE DATABASE ... STRATEGY FILE_COPY: the template's files as of now, as images."""
        reader = self.w.reader
        at = self.tl.last_record_lsn
        await mod.put_dbdir_creation(spc, db)
        for tag in sorted(await reader.list_rels(src_spc, src_db, at)):
            n = await reader.get_rel_size(tag, at)
            new: RelKey = (spc, db, tag.rel, tag.fork)
            await mod.put_rel_creation(new, n)
            for start in range(0, n, 256):
                blknos = list(range(start, min(n, start + 256)))
                pages = await reader.get_pages(tag, blknos, at)
                for b, page in zip(blknos, pages, strict=True):
                    await mod.put_rel_page(new, b, Image(page))
        try:
            relmap = await self.tl.get(relmap_file_key(src_spc, src_db), at)
        except MissingKeyError:
            return
        await mod.put_relmap_file(spc, db, relmap)

    # -- transactions and CLOG --

    async def _xact(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        op = rec.xl_info & XLOG_XACT_OPMASK
        if op == XLOG_XACT_PREPARE:
            await mod.put_twophase_file(rec.xl_xid, rec.main_data)
            return
        if op not in (XLOG_XACT_COMMIT, XLOG_XACT_ABORT, XLOG_XACT_COMMIT_PREPARED, XLOG_XACT_ABORT_PREPARED):
            return
        parsed = parse_xact(rec)
        prepared = op in (XLOG_XACT_COMMIT_PREPARED, XLOG_XACT_ABORT_PREPARED)
        if prepared:
            if parsed.twophase_xid is None:
                raise _bad(rec, "a PREPARED record without its two-phase xid")
            xid = parsed.twophase_xid
        else:
            xid = rec.xl_xid
        committed = op in (XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED)
        by_page: dict[int, list[int]] = {}
        for x in (xid, *parsed.subxacts):
            by_page.setdefault(x // CLOG_XACTS_PER_PAGE, []).append(x)
        for pageno, xids in by_page.items():
            value: Value = (
                ClogSetCommitted(tuple(xids), parsed.xact_time) if committed else ClogSetAborted(tuple(xids))
            )
            await mod.put_slru_page(
                SLRU_CLOG, pageno // SLRU_PAGES_PER_SEGMENT, pageno % SLRU_PAGES_PER_SEGMENT, value
            )
        for spc, db, relnode in parsed.rels:
            for fork in range(4):
                rel: RelKey = (spc, db, relnode, fork)
                if await mod.get_rel_size(rel) is not None:
                    await mod.put_rel_drop(rel)
        if prepared:
            await mod.drop_twophase_file(xid)
        if committed and await self._track_commit_ts(mod):
            await self._commit_ts_entries(rec, mod, (xid, *parsed.subxacts))
        for x in parsed.subxacts:
            await self._update_next_xid(mod, x)

    # -- commit timestamps (pg_commit_ts) --

    async def _track_commit_ts(self, mod: DatadirModification) -> bool:
        if self._commit_ts_on is None:
            try:
                raw = await self.w.reader.get_control_file(self.tl.last_record_lsn)
                self._commit_ts_on = parse_control_file(raw).track_commit_timestamp
            except Exception:  # a timeline without pg_control (synthetic WAL in tests)
                self._commit_ts_on = False
        return self._commit_ts_on

    async def _parameter_change(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        """The compute started with other settings: pg_control takes them (as PostgreSQL's redo
        of PARAMETER_CHANGE does), track_commit_timestamp among them."""
        conns, workers, senders, prepared, locks, wal_level, hints, track = _unpack(
            _PARAMETER_CHANGE, rec, "XLOG/PARAMETER_CHANGE")
        hints, track = bool(hints), bool(track)
        try:
            raw = await self.w.reader.get_control_file(self.tl.last_record_lsn)
            control = parse_control_file(raw)
        except Exception:
            self._commit_ts_on = track
            return
        await mod.put_control_file(encode_control_file(attrs.evolve(
            control, max_connections=conns, max_worker_processes=workers, max_wal_senders=senders,
            max_prepared_xacts=prepared, max_locks_per_xact=locks, wal_level=wal_level,
            wal_log_hints=hints, track_commit_timestamp=track)))
        self._commit_ts_on = track

    async def _commit_ts_entries(self, rec: DecodedRecord, mod: DatadirModification, xids: Sequence[int]) -> None:
        """The raw commit record on every commit_ts page its xids live on (redo sets the
        entries: walredo/commit_ts.py). The page active at the time track_commit_timestamp was
        turned on is zeroed by PostgreSQL without WAL: a missing page starts as zeros here too."""
        cp = mod.checkpoint if mod.checkpoint is not None else self.w.checkpoint
        if cp is None:
            cp = await mod.get_checkpoint()
        if cp.oldest_commit_ts_xid == 0:
            # the first commit with a timestamp (ActivateCommitTs keeps this range in memory
            # until the next checkpoint); the basebackup extends newest to its nextXid
            mod.put_checkpoint(attrs.evolve(cp, oldest_commit_ts_xid=xids[0], newest_commit_ts_xid=xids[0]))
        for pageno in sorted({x // COMMIT_TS_XACTS_PER_PAGE for x in xids}):
            segno, rpage = divmod(pageno, SLRU_PAGES_PER_SEGMENT)
            size = await mod.get_slru_segment_size(SLRU_COMMIT_TS, segno)
            will_init = size is None or rpage >= size  # the record starts the page from zeros
            if size is None:
                await mod.put_slru_segment_creation(SLRU_COMMIT_TS, segno, rpage + 1)
            elif rpage >= size:
                await mod.put_slru_extend(SLRU_COMMIT_TS, segno, rpage + 1)
            await mod.put_slru_page(SLRU_COMMIT_TS, segno, rpage, PostgresRecord(will_init, rec.raw))

    async def _commit_ts(self, rec: DecodedRecord, mod: DatadirModification, info: int) -> None:
        if info == COMMIT_TS_ZEROPAGE:
            (pageno,) = _unpack(_I32, rec, "CommitTs/ZEROPAGE")
            await self._zero_slru_page(mod, SLRU_COMMIT_TS, pageno)
        elif info == COMMIT_TS_TRUNCATE:
            pageno, oldest_xid = _unpack(_COMMIT_TS_TRUNCATE, rec, "CommitTs/TRUNCATE")
            cp = await mod.get_checkpoint()
            mod.put_checkpoint(attrs.evolve(cp, oldest_commit_ts_xid=oldest_xid))
            for segno in sorted(await mod.list_slru_segments(SLRU_COMMIT_TS)):
                last = segno * SLRU_PAGES_PER_SEGMENT + SLRU_PAGES_PER_SEGMENT - 1
                if commit_ts_page_precedes(last, pageno):  # whole segments before the cut
                    await mod.drop_slru_segment(SLRU_COMMIT_TS, segno)

    async def _zero_slru_page(self, mod: DatadirModification, kind: int, pageno: int) -> None:
        if pageno < 0:
            raise RemoteProtocolError(f"negative SLRU page number {pageno}", sqlstate=DATA_CORRUPTED)
        segno, rpage = divmod(pageno, SLRU_PAGES_PER_SEGMENT)
        size = await mod.get_slru_segment_size(kind, segno)
        if size is None:
            await mod.put_slru_segment_creation(kind, segno, rpage + 1)
        elif rpage >= size:
            await mod.put_slru_extend(kind, segno, rpage + 1)
        await mod.put_slru_page(kind, segno, rpage, Image(ZERO_PAGE))

    async def _clog(self, rec: DecodedRecord, mod: DatadirModification, info: int) -> None:
        if info == CLOG_ZEROPAGE:
            (pageno,) = _unpack(_I32, rec, "CLOG/ZEROPAGE")
            await self._zero_slru_page(mod, SLRU_CLOG, pageno)
        elif info == CLOG_TRUNCATE:
            pageno, oldest_xid, oldest_db = _unpack(_CLOG_TRUNCATE, rec, "CLOG/TRUNCATE")
            cp = await mod.get_checkpoint()
            mod.put_checkpoint(attrs.evolve(cp, oldest_xid=oldest_xid, oldest_xid_db=oldest_db))
            for segno in sorted(await mod.list_slru_segments(SLRU_CLOG)):
                first = segno * SLRU_PAGES_PER_SEGMENT
                last = first + SLRU_PAGES_PER_SEGMENT - 1
                if clog_page_precedes(first, pageno) and clog_page_precedes(last, pageno):
                    await mod.drop_slru_segment(SLRU_CLOG, segno)

    # -- multixacts --

    async def _multixact(self, rec: DecodedRecord, mod: DatadirModification, info: int) -> None:
        if info == XLOG_MULTIXACT_ZERO_OFF_PAGE:
            (pageno,) = _unpack(_I32, rec, "MultiXact/ZERO_OFF_PAGE")
            await self._zero_slru_page(mod, SLRU_MULTIXACT_OFFSETS, pageno)
        elif info == XLOG_MULTIXACT_ZERO_MEM_PAGE:
            (pageno,) = _unpack(_I32, rec, "MultiXact/ZERO_MEM_PAGE")
            await self._zero_slru_page(mod, SLRU_MULTIXACT_MEMBERS, pageno)
        elif info == XLOG_MULTIXACT_CREATE_ID:
            await self._multixact_create(rec, mod)
        elif info == XLOG_MULTIXACT_TRUNCATE_ID:
            oldest_db, start_off, end_off, start_memb, end_memb = _unpack(
                _MX_TRUNCATE, rec, "MultiXact/TRUNCATE_ID"
            )
            cp = await mod.get_checkpoint()
            mod.put_checkpoint(attrs.evolve(cp, oldest_multi=end_off, oldest_multi_db=oldest_db))
            await self._drop_segments(
                mod, SLRU_MULTIXACT_MEMBERS,
                start_memb // MULTIXACT_MEMBERS_PER_PAGE // SLRU_PAGES_PER_SEGMENT,
                end_memb // MULTIXACT_MEMBERS_PER_PAGE // SLRU_PAGES_PER_SEGMENT,
                MAX_MULTIXACT_OFFSET // MULTIXACT_MEMBERS_PER_PAGE // SLRU_PAGES_PER_SEGMENT,
            )
            await self._drop_segments(
                mod, SLRU_MULTIXACT_OFFSETS,
                start_off // MULTIXACT_OFFSETS_PER_PAGE // SLRU_PAGES_PER_SEGMENT,
                end_off // MULTIXACT_OFFSETS_PER_PAGE // SLRU_PAGES_PER_SEGMENT,
                0xFFFF_FFFF // MULTIXACT_OFFSETS_PER_PAGE // SLRU_PAGES_PER_SEGMENT,
            )

    async def _drop_segments(
        self, mod: DatadirModification, kind: int, start: int, end: int, maxseg: int
    ) -> None:
        """Drop segments start, start+1, ... (wrapping after ``maxseg``) up to, not including,
        ``end``: the last one may still hold live entries."""
        existing = await mod.list_slru_segments(kind)
        seg = start
        steps = 0
        while seg != end and steps <= maxseg:
            if seg in existing:
                await mod.drop_slru_segment(kind, seg)
            seg = 0 if seg == maxseg else seg + 1
            steps += 1

    async def _multixact_create(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        mid, moff, n = _unpack(_MX_CREATE, rec, "MultiXact/CREATE_ID")
        if n < 0 or len(rec.main_data) < _MX_CREATE.size + n * _MX_MEMBER.size:
            raise _bad(rec, f"{n} members run past the record")
        members = [
            (int(x), int(s) & 0xFF)
            for x, s in (_MX_MEMBER.unpack_from(rec.main_data, _MX_CREATE.size + i * 8) for i in range(n))
        ]
        # PostgreSQL >= 15.15 (RecordNewMultiXact) also writes the next multixact's offset, on
        # the next page when mid is the last entry of its page: redo of the raw record does both.
        raw = PostgresRecord(False, rec.raw)
        next_mid, _ = next_multi_offset(mid, moff, n)
        for pageno in sorted({mid // MULTIXACT_OFFSETS_PER_PAGE, next_mid // MULTIXACT_OFFSETS_PER_PAGE}):
            await mod.put_slru_page(
                SLRU_MULTIXACT_OFFSETS,
                pageno // SLRU_PAGES_PER_SEGMENT,
                pageno % SLRU_PAGES_PER_SEGMENT,
                raw,
            )
        i = 0
        while i < n:
            off = (moff + i) & 0xFFFF_FFFF
            mpage = off // MULTIXACT_MEMBERS_PER_PAGE
            j = i
            while j < n and ((moff + j) & 0xFFFF_FFFF) // MULTIXACT_MEMBERS_PER_PAGE == mpage:
                j += 1
            await mod.put_slru_page(
                SLRU_MULTIXACT_MEMBERS,
                mpage // SLRU_PAGES_PER_SEGMENT,
                mpage % SLRU_PAGES_PER_SEGMENT,
                MultixactMembersCreate(off, tuple(members[i:j])),
            )
            i = j
        cp = await mod.get_checkpoint()
        next_multi, next_moff = cp.next_multi, cp.next_multi_offset
        if xid_follows_or_equals(mid, next_multi):
            next_multi = (mid + 1) & 0xFFFF_FFFF
        end_off = (moff + n) & 0xFFFF_FFFF
        if xid_follows_or_equals(end_off, next_moff):
            next_moff = end_off
        if (next_multi, next_moff) != (cp.next_multi, cp.next_multi_offset):
            mod.put_checkpoint(attrs.evolve(cp, next_multi=next_multi, next_multi_offset=next_moff))
        for xid, _status in members:
            await self._update_next_xid(mod, xid)

    # -- checkpoint key --

    async def _update_next_xid(self, mod: DatadirModification, xid: int) -> None:
        cp = mod.checkpoint if mod.checkpoint is not None else self.w.checkpoint
        if cp is None:
            cp = await mod.get_checkpoint()
        next_xid = cp.next_xid & 0xFFFF_FFFF
        if xid_precedes(xid, next_xid):
            return
        epoch = cp.next_xid >> 32
        new = (xid + XID_CHECKPOINT_INTERVAL) & ~(XID_CHECKPOINT_INTERVAL - 1) & 0xFFFF_FFFF
        if new < next_xid:
            epoch += 1
        mod.put_checkpoint(attrs.evolve(cp, next_xid=(epoch << 32) | new))

    async def _checkpoint(self, rec: DecodedRecord, mod: DatadirModification) -> None:
        if len(rec.main_data) < SIZEOF_CHECKPOINT:
            raise _bad(rec, f"checkpoint record has {len(rec.main_data)} bytes")
        logged = CheckPoint.decode(rec.main_data)
        cp = await mod.get_checkpoint()
        next_xid = cp.next_xid if cp.next_xid >= logged.next_xid else logged.next_xid
        oldest_xid = cp.oldest_xid
        if xid_precedes(cp.oldest_xid, logged.oldest_xid):
            oldest_xid = logged.oldest_xid
        mod.put_checkpoint(
            attrs.evolve(
                logged,
                next_xid=next_xid,
                next_oid=max(cp.next_oid, logged.next_oid),
                oldest_xid=oldest_xid,
                next_multi=cp.next_multi
                if xid_precedes(logged.next_multi, cp.next_multi)
                else logged.next_multi,
                next_multi_offset=cp.next_multi_offset
                if xid_precedes(logged.next_multi_offset, cp.next_multi_offset)
                else logged.next_multi_offset,
            )
        )


# --- WAL from segment files --------------------------------------------------------------------


def read_wal_segments(
    get_segment: Callable[[int], bytes | None], start_lsn: Lsn
) -> Iterator[DecodedRecord | EndOfWal]:
    """Records from ``start_lsn`` (a record start) to the end of valid WAL, reading whole
    segments by number from ``get_segment`` (``None``: no such segment); the last item is
    the ``EndOfWal``."""
    segno = start_lsn // WAL_SEGMENT_SIZE
    seg_start = segno * WAL_SEGMENT_SIZE
    offset = (start_lsn - seg_start) & ~(XLOG_BLCKSZ - 1)
    dec = WalStreamDecoder(start_lsn, data_start=seg_start + offset)
    while True:
        data = get_segment(segno)
        if data is None:
            yield dec.finish()
            return
        dec.feed(memoryview(data)[offset:])
        while True:
            item = dec.next_record()
            if isinstance(item, DecodedRecord):
                yield item
            elif isinstance(item, EndOfWal):
                yield item
                return
            else:
                break
        segno += 1
        offset = 0


def read_wal_dir(wal_dir: Path, start_lsn: Lsn) -> Iterator[DecodedRecord | EndOfWal]:
    """``read_wal_segments`` over a pg_wal directory."""

    def get(segno: int) -> bytes | None:
        path = wal_dir / segment_file_name(segno)
        return path.read_bytes() if path.exists() else None

    return read_wal_segments(get, start_lsn)


async def ingest_wal(
    ingest: WalIngest, records: Iterable[DecodedRecord | EndOfWal], end_lsn: Lsn | None = None
) -> EndOfWal | None:
    """Ingest records until the ``EndOfWal`` (returned) or the first record starting at or
    after ``end_lsn`` (then ``None``)."""
    for item in records:
        if isinstance(item, EndOfWal):
            return item
        if end_lsn is not None and item.lsn >= end_lsn:
            return None
        await ingest.ingest_record(item)
        await trio.lowlevel.checkpoint_if_cancelled()
    return None


async def ingest_wal_dir(
    ingest: WalIngest, wal_dir: Path, start_lsn: Lsn, end_lsn: Lsn | None = None
) -> Lsn:
    """Ingest a pg_wal directory's records from ``start_lsn`` until the end of valid WAL (or
    ``end_lsn``); returns the timeline's ``last_record_lsn``."""
    await ingest_wal(ingest, read_wal_dir(wal_dir, start_lsn), end_lsn)
    return ingest.tl.last_record_lsn


# --- connecting W's WAL receiver ---------------------------------------------------------------


class TimelineWalIngest:
    """A timeline's WAL ingest fed by a ``WalReceiver`` (safekeepers or a PostgreSQL).

    Streaming starts at the timeline's ``last_record_lsn``; after a restart that is
    ``disk_consistent_lsn`` (the in-memory layer is lost and re-ingested). Records the
    timeline already has are skipped, so an overlapping stream applies nothing twice.
    """

    def __init__(
        self,
        timeline: Timeline,
        cfg: WalReceiverConfig,
        *,
        connect: Connector = pgclient_connect,
        ingest: WalIngest | None = None,
        remote_wal: RemoteWal | None = None,
    ) -> None:
        self.tl = timeline
        self.cfg = cfg
        self._remote_wal = remote_wal
        self.ingest = ingest if ingest is not None else WalIngest(timeline)
        self._connect = connect
        self.receiver: WalReceiver | None = None
        self._in_record = False
        self._between: trio.Event | None = None  # set when the record in progress is done
        self._flush_done: trio.Event | None = None  # set while a flush runs

    def progress(self) -> Progress:
        return Progress(self.tl.disk_consistent_lsn, self.tl.remote_consistent_lsn)

    async def _on_record(self, rec: DecodedRecord) -> None:
        await self._applying(self.ingest.ingest_record(rec))

    async def _on_records(self, recs: list[DecodedRecord]) -> None:
        # a flush waits for the whole batch (a few ms of WAL)
        await self._applying(self.ingest.ingest_records(recs))

    async def _on_wal(self, dec: WalStreamDecoder) -> tuple[int, Lsn, NeedData | EndOfWal]:
        # the fused path (a flush waits for one XLogData message's records, like a batch)
        out: list[tuple[int, Lsn, NeedData | EndOfWal]] = []

        async def apply() -> None:
            out.append(await self.ingest.ingest_decoder(dec))

        await self._applying(apply())
        return out[0]

    async def _applying(self, apply: Coroutine[Any, Any, object]) -> None:
        # A flush must not interleave with the puts of a record. trio.Lock costs a schedule
        # point per record (about 6 µs, a quarter of the whole per-record cost), so the hot
        # path only tests a flag.
        try:
            while self._flush_done is not None:
                await self._flush_done.wait()
        except BaseException:
            apply.close()  # never started: no "was never awaited" warning
            raise
        self._in_record = True
        try:
            await apply
        except BaseException:
            # a half-applied record must not leave stale sizes or directories behind
            self.ingest.w.invalidate()
            raise
        finally:
            self._in_record = False
            if self._between is not None:
                self._between.set()

    async def pause(self) -> None:
        """Hold every later record back, and return once none is being applied: the ingest
        then sits between two records, so cancelling it (shutdown) leaves no record partly
        put, and the timeline's flush has nothing to wait for. Not undone (shutdown only)."""
        while self._flush_done is not None:  # a flush in progress would release the hold
            await self._flush_done.wait()
        self._flush_done = trio.Event()  # never set: _on_record(s) and flush() wait on it
        while self._in_record:
            between = self._between = trio.Event()
            await between.wait()
        self._between = None

    async def flush(self) -> Lsn:
        """Flush the timeline between two records (a flush must not interleave with the puts
        of a record); returns ``disk_consistent_lsn``."""
        while self._flush_done is not None:
            await self._flush_done.wait()
        done = self._flush_done = trio.Event()
        try:
            while self._in_record:
                between = self._between = trio.Event()
                await between.wait()
            self._between = None
            await self.tl.flush()
        finally:
            self._flush_done = None
            done.set()
        return self.tl.disk_consistent_lsn

    async def run(self) -> None:
        start = self.tl.last_record_lsn
        log.info("wal ingest starting", timeline_id=self.tl.timeline_id.hex, start=format_lsn(start))
        self.receiver = WalReceiver(
            self.cfg,
            start_lsn=start,
            on_wal=self._on_wal,
            progress=self.progress,
            connect=self._connect,
            remote_wal=self._remote_wal,
        )
        await self.receiver.run()


__all__ = [
    "IngestStats",
    "ParsedXact",
    "TimelineWalIngest",
    "WalIngest",
    "ingest_wal",
    "ingest_wal_dir",
    "parse_xact",
    "pgclient_connect",
    "read_wal_dir",
    "read_wal_segments",
]
