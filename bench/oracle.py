"""``pagestore verify oracle``: every page the pageserver serves equals PostgreSQL's own.

The end-to-end proof of WAL redo and ingest (issue 8, "the oracle test"). A local cluster (one
pageserver with ``validate_redo`` on, N safekeepers) and a primary endpoint (vanilla PostgreSQL
15 + the walproposer bridge) run pgbench and a set of workloads (btree splits and new roots,
deletes + VACUUM incl. page deletion and relation truncation, HOT and non-HOT updates,
multixacts from two sessions, sequences, TOAST, CREATE INDEX, TRUNCATE, subtransactions with
rollbacks, an unlogged table). The workload sessions run with ``wal_consistency_checking =
'all'``, so the pageserver's redo also compares each of their records with PostgreSQL's image.

At four points the workload is paused (nothing else writes: autovacuum is off) and a CHECKPOINT
makes the data files equal to the WAL up to the insert LSN L. The first three are copied (the
relation files and SLRU directories); the last is the live directory at the end. For each:
every relation file of every database (found on disk; its kind from that database's pg_class)
and every fork, Nblocks and every block through pagestream GetPage@L (@latest for the last)
against the file, both masked as PostgreSQL's ``bufmask`` does for the kind; and every SLRU
segment (pg_xact, pg_multixact offsets and members) through GetSlruSegment, byte for byte.

Masking beyond bufmask, each for a reason PostgreSQL itself has:
- sequences: ``nextval`` WAL-logs the tuple 32 values ahead and keeps the true value in the
  buffer, so a replayed page holds the logged state; the check is exact on that: the served
  tuple has ``log_cnt = 0`` and ``last_value = file.last_value + file.log_cnt * increment``;
- blocks past the pageserver's end of a fork must be all-zero pages (PostgreSQL extends
  relations without WAL, e.g. ``RelationAddExtraBlocks``), for the VM fork an initialized page
  with no bit set (``vm_extend``);
- FSM forks are not WAL-logged at all: compared and reported, never a failure;
- unlogged relations: only the init fork is WAL-logged, so only it is compared;
- SP-GiST metapages (block 0): the last-used-page cache is rewritten without WAL
  (``SpGistUpdateMetaPage``); where a reference standby is given, a metapage differing from
  the file only there is accepted when it equals the standby's (``spgist_meta_as_postgres``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import psycopg
import trio

from compute import postgres
from compute.page_client import PageClient, PageRequestFailed
from control_plane import cluster, endpoint
from control_plane.local_env import LocalEnv, plan_ports
from pageserver.basebackup import RELSEG_SIZE, read_datadir_block, rel_file_path
from pageserver.pgdatadir import BLCKSZ, DEFAULTTABLESPACE_OID, GLOBALTABLESPACE_OID
from pageserver.walredo import bufpage as bp
from pageserver.walredo.mask import (
    RM_MASKS,
    MaskFn,
    fsm_vm_mask,
    heap_mask,
    mask_page_hint_bits,
    mask_page_lsn_and_checksum,
    mask_unused_space,
    seq_mask,
)
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn, parse_lsn
from protocol.pagestream import (
    MAX_LSN,
    ErrorResponse,
    ExistsRequest,
    ExistsResponse,
    GetPageRequest,
    GetPageResponse,
    NblocksRequest,
    NblocksResponse,
    RelTag,
    Request,
    Response,
    SlruKind,
)
from protocol.wal.rmgr import RmgrId

FORKS = {"": 0, "_fsm": 1, "_vm": 2, "_init": 3}
FORK_NAMES = {0: "main", 1: "fsm", 2: "vm", 3: "init"}
_REL_FILE = re.compile(r"^(\d+)(_fsm|_vm|_init)?(?:\.(\d+))?$")
SLRU_DIRS = {SlruKind.CLOG: "pg_xact", SlruKind.MULTIXACT_OFFSETS: "pg_multixact/offsets",
             SlruKind.MULTIXACT_MEMBERS: "pg_multixact/members"}
# GetPage requests in flight while the pages compare (the pageserver batches what is queued)
QUEUE_DEPTH = 64
REFILL = 16  # the window is topped up when this many answers came back
_SEQ_DATA = struct.Struct("<qq?")  # FormData_pg_sequence_data: last_value, log_cnt, is_called


def generic_mask(page: bytearray, blkno: int) -> None:
    """PostgreSQL's ``generic_mask`` (any page without a kind-specific mask)."""
    mask_page_lsn_and_checksum(page)
    mask_page_hint_bits(page)
    mask_unused_space(page)


# -- what is on disk -------------------------------------------------------------------------------


@attrs.frozen
class RelInfo:
    """One relation as pg_class describes it (per database; shared ones with db 0)."""

    name: str
    kind: str  # heap, sequence, or the index access method (btree, hash, gin, gist, spgist, brin, ...)
    persistence: str  # p, u, t
    seq_increment: int = 0


@attrs.frozen
class Fork:
    rel: RelTag
    nblocks: int  # from the file sizes
    info: RelInfo | None  # None: a file pg_class does not know (a dropped relation's stub)

    def describe(self) -> str:
        name = self.info.name if self.info else "?"
        return (f"{name} ({self.rel.spcnode}/{self.rel.dbnode}/{self.rel.relnode}) "
                f"fork {FORK_NAMES[self.rel.forknum]}")


@attrs.define
class Snapshot:
    """A data directory (a copy, or the live one) with the catalog knowledge of that moment."""

    label: str
    lsn: Lsn
    root: Path
    rels: dict[tuple[int, int], RelInfo]  # (db or 0 for shared, relfilenode) -> info
    latest: bool = False  # compare GetPage@latest rather than @lsn
    # PostgreSQL's own redo of the same WAL to ``lsn`` (a standby's data directory after a
    # restartpoint): where present, a VM page with fewer bits than the file is accepted when
    # the standby lost exactly the same ones, and an SP-GiST metapage when it equals the
    # standby's (its lastUsedPages cache is updated without WAL)
    reference: Path | None = None


def _kind(relkind: str, amname: str) -> str:
    if relkind in ("r", "t", "m"):
        return "heap"  # every table access method of PostgreSQL 15 (heap, and aliases of it) writes heap pages
    if relkind == "S":
        return "sequence"
    if relkind == "i" and amname:
        return amname
    return "generic"


# index access method -> the resource manager whose rm_mask masks its pages
AM_RMGR = {"btree": RmgrId.BTREE, "hash": RmgrId.HASH, "gin": RmgrId.GIN, "gist": RmgrId.GIST,
           "spgist": RmgrId.SPGIST, "brin": RmgrId.BRIN}


def catalog_rels(dsn_of: Callable[[str], str]) -> dict[tuple[int, int], RelInfo]:
    """Every relation with storage of every database, keyed by (db, relfilenode)."""
    rels: dict[tuple[int, int], RelInfo] = {}
    with psycopg.connect(dsn_of("postgres"), autocommit=True) as conn:
        dbs = conn.execute("SELECT oid, datname FROM pg_database").fetchall()
    for db_oid, datname in dbs:
        with psycopg.connect(dsn_of(datname), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_relation_filenode(c.oid), c.relisshared, c.relkind, c.relpersistence, "
                "coalesce(am.amname, ''), c.relname, coalesce(s.seqincrement, 0) "
                "FROM pg_class c LEFT JOIN pg_am am ON am.oid = c.relam "
                "LEFT JOIN pg_sequence s ON s.seqrelid = c.oid "
                "WHERE pg_relation_filenode(c.oid) IS NOT NULL"
            ).fetchall()
        for filenode, shared, relkind, persistence, amname, relname, inc in rows:
            key = (0 if shared else int(db_oid), int(filenode))
            rels[key] = RelInfo(f"{datname}.{relname}" if not shared else relname,
                                _kind(relkind, amname), persistence, int(inc))
    return rels


def list_forks(snap: Snapshot) -> list[Fork]:
    """Every relation fork file under ``base/``, ``global/`` and ``pg_tblspc/`` of the snapshot."""
    sizes: Counter[tuple[int, int, int, int]] = Counter()
    dirs = [(GLOBALTABLESPACE_OID, 0, snap.root / "global")]
    dirs += [(DEFAULTTABLESPACE_OID, int(d.name), d) for d in sorted((snap.root / "base").iterdir())
             if d.name.isdigit()]
    tblspc = snap.root / "pg_tblspc"
    if tblspc.is_dir():  # pg_tblspc/<spc oid>/PG_15_<catversion>/<db oid>/ (a symlink or in place)
        for spc in sorted(tblspc.iterdir()):
            if spc.name.isdigit():
                for vdir in sorted(spc.glob("PG_15_*")):
                    dirs += [(int(spc.name), int(d.name), d) for d in sorted(vdir.iterdir()) if d.name.isdigit()]
    for spcnode, db, d in dirs:
        for f in d.iterdir():
            m = _REL_FILE.match(f.name)
            if not m:
                continue
            key = (spcnode, db, int(m.group(1)), FORKS[m.group(2) or ""])
            seg = int(m.group(3) or 0)
            size = f.stat().st_size
            if size % BLCKSZ:
                raise RuntimeError(f"{f}: size {size} is not a multiple of {BLCKSZ}")
            sizes[key] = max(sizes[key], seg * RELSEG_SIZE + size // BLCKSZ)
    return [Fork(RelTag(*key), n, snap.rels.get((key[1], key[2]))) for key, n in sorted(sizes.items())]


# -- comparison ------------------------------------------------------------------------------------


def _diff(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """How many bytes differ (0 at the cost of one comparison for the usual, equal pages)."""
    if a == b:
        return 0
    return sum(1 for x, y in zip(a, b, strict=True) if x != y)


def _masked(page: bytes, blkno: int, mask: MaskFn) -> bytes | str:
    copy = bytearray(page)
    try:
        mask(copy, blkno)
    except Exception as exc:  # a page the mask cannot parse is itself a finding
        return f"unmaskable page: {exc}"
    return bytes(copy)


def _seq_fields(page: bytearray) -> tuple[int, int, int, bool] | None:
    """(offset of the data, last_value, log_cnt, is_called) of a sequence page's tuple."""
    if bp.max_offset(page) != 1:
        return None
    raw = bp.get_itemid(page, 1)
    item = raw & 0x7FFF
    t_hoff = page[item + 22]
    pos = item + t_hoff
    last, cnt, called = _SEQ_DATA.unpack_from(page, pos)
    return pos, last, cnt, called


def compare_sequence(served: bytes, local: bytes, increment: int) -> tuple[int, str]:
    """Differing bytes (0 = equal) and a note. Exact on what ``nextval`` WAL-logs: the served
    tuple is the logged one (``log_cnt`` 0, ``log_cnt`` values ahead of the file's)."""
    a, b = bytearray(served), bytearray(local)
    seq_mask(a, 0)
    seq_mask(b, 0)
    fa, fb = _seq_fields(a), _seq_fields(b)
    if fa is None or fb is None or fa[0] != fb[0]:
        return _diff(a, b), "not a one-tuple sequence page"
    pos, s_last, s_cnt, s_called = fa
    _, f_last, f_cnt, f_called = fb
    if (s_last, s_cnt, s_called) != (f_last, f_cnt, f_called):
        expect = f_last + f_cnt * increment
        if not (s_cnt == 0 and s_called == f_called and s_last == expect):
            return _diff(a, b), (f"sequence tuple served last_value {s_last} log_cnt {s_cnt}, file "
                                 f"{f_last} + {f_cnt} x {increment} = {expect}")
        # the logged-ahead state: equal by construction; compare the rest of the page
        a[pos:pos + 16] = b[pos:pos + 16]
    return _diff(a, b), ""


def _reason(message: str) -> str:
    """What an unreadable page's error says, without what names the page or LSN: ``Read error:
    could not reconstruct key 0000…0001 at 0/741D98F0: no redo for resource manager Hash
    (Hash/INSERT) (record ending at 0/741D98F0)`` -> ``no redo for resource manager Hash
    (Hash/INSERT)``."""
    m = re.search(r"could not reconstruct key [0-9A-Fa-f]+ at [0-9A-F]+/[0-9A-F]+: (.*)", message)
    text = m.group(1) if m else message
    text = re.sub(r"\s*\((record )?(ending )?at [0-9A-F]+/[0-9A-F]+\)", "", text)
    text = re.sub(r"\b[0-9A-F]+/[0-9A-F]+\b", "X/X", text)
    return text.strip(" :,;")[:160]


def _vm_lost_as_postgres(served: bytes, local: bytes, reference: bytes | None) -> bool:
    """The served VM page has a subset of the file's bits, and exactly the bits PostgreSQL's own
    redo has (``reference``: the standby's page, None where its file has no such block)."""
    head = bp.SIZE_OF_PAGE_HEADER
    if reference is None or any(s & ~f for s, f in zip(served[head:], local[head:], strict=True)):
        return False
    return served[head:] == reference[head:]


# SpGistMetaPageData after the page header: magicNumber u32, then lastUsedPages (8 x
# (blkno u32, freeSpace i32)), which SpGistUpdateMetaPage rewrites without WAL
_SPGIST_LUP_CACHE = (bp.SIZE_OF_PAGE_HEADER + 4, bp.SIZE_OF_PAGE_HEADER + 4 + 8 * 8)


def _spgist_meta_as_postgres(served: bytes, local: bytes, reference: bytes | None, mask: MaskFn) -> bool:
    """An SP-GiST metapage differing from the file only in its last-used-page cache, and equal
    to PostgreSQL's own redo of the same WAL (``reference``: the standby's page): the cache is
    a hint the primary never WAL-logs."""
    if reference is None:
        return False
    a, b, r = _masked(served, 0, mask), _masked(local, 0, mask), _masked(reference, 0, mask)
    if not (isinstance(a, bytes) and isinstance(b, bytes) and isinstance(r, bytes)) or a != r:
        return False
    lo, hi = _SPGIST_LUP_CACHE
    return a[:lo] == b[:lo] and a[hi:] == b[hi:]


def _reference_block(root: Path, rel: RelTag, blkno: int) -> bytes | None:
    try:
        page = read_datadir_block(root, rel, blkno)
    except OSError:
        return None
    return page if len(page) == BLCKSZ else None


def _is_zero(page: bytes) -> bool:
    return page.count(0) == BLCKSZ


def _empty_vm_page(page: bytes) -> bool:
    """An initialized VM page with no bit set, or a new (all-zero) one."""
    if _is_zero(page):
        return True
    return page.count(0, bp.SIZE_OF_PAGE_HEADER) == BLCKSZ - bp.SIZE_OF_PAGE_HEADER


@attrs.define
class SnapshotResult:
    label: str
    lsn: str
    forks: int = 0
    nblocks_equal: int = 0
    pages: Counter[str] = attrs.field(factory=Counter)
    equal: Counter[str] = attrs.field(factory=Counter)
    unreadable: Counter[str] = attrs.field(factory=Counter)  # GetPage failed, per kind
    different: Counter[str] = attrs.field(factory=Counter)  # served, but not equal after the mask
    unreadable_reasons: Counter[str] = attrs.field(factory=Counter)  # the error's first clause
    nblocks_file_longer: int = 0  # forks PostgreSQL extended without WAL (not FSM)
    new_pages_past_end: int = 0  # their blocks past the pageserver's end: all new pages
    fsm_nblocks_differ: int = 0
    fsm_pages: int = 0
    fsm_equal: int = 0
    sequences_logged_ahead: int = 0
    vm_bits_lost_as_postgres: int = 0  # VM pages with fewer bits than the file, as the standby's
    spgist_meta_as_postgres: int = 0  # SP-GiST metapages whose unlogged page cache is the standby's
    skipped_unlogged_forks: int = 0
    slru_segments: int = 0
    slru_pages: int = 0
    slru_equal: int = 0
    mismatches: list[str] = attrs.field(factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["mismatches"] = len(self.mismatches)
        d["first_mismatches"] = self.mismatches[:20]
        for name in ("pages", "equal", "unreadable", "different", "unreadable_reasons"):
            d[name] = dict(getattr(self, name))
        return d


def _mask_for(fork: Fork) -> tuple[str, MaskFn]:
    if fork.rel.forknum == 2:
        return "vm", fsm_vm_mask
    kind = fork.info.kind if fork.info else "generic"
    if kind in AM_RMGR:  # the index masks their resource managers register (generic until then)
        return kind, RM_MASKS.get(AM_RMGR[kind], generic_mask)
    return kind, {"heap": heap_mask, "sequence": seq_mask}.get(kind, generic_mask)


class _ForkFile:
    """The file side of the fork being compared, read in bulk: one read per segment file,
    kept only while that fork's pages arrive (they arrive in request order, fork by fork)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rel: RelTag | None = None
        self.segments: dict[int, bytes] = {}

    def block(self, rel: RelTag, blkno: int) -> bytes:
        if rel != self.rel:
            self.rel, self.segments = rel, {}
        segno, off = divmod(blkno, RELSEG_SIZE)
        data = self.segments.get(segno)
        if data is None:
            data = self.segments[segno] = (self.root / rel_file_path(rel, segno)).read_bytes()
        page = data[off * BLCKSZ:(off + 1) * BLCKSZ]
        if len(page) != BLCKSZ:
            raise EOFError(f"{self.root / rel_file_path(rel, segno)}: block {blkno} is short ({len(page)} bytes)")
        return page


async def _answers(client: PageClient, requests: Sequence[Request]) -> list[Response]:
    """The answers to ``requests``, pipelined; a per-request error is raised (a fork whose size
    the pageserver cannot tell is not a comparison but a failure)."""
    out = await client.pipelined(requests, QUEUE_DEPTH)
    for resp in out:
        if isinstance(resp, ErrorResponse):
            raise PageRequestFailed(resp)
    return out


async def _stream(client: PageClient, requests: Sequence[GetPageRequest],
                  on_answer: Callable[[int, Response], None]) -> None:
    """``requests`` with up to QUEUE_DEPTH in flight, each answer handed to ``on_answer`` as it
    arrives, so the pageserver serves the next pages while this process compares one. One task
    sends and receives: the window is refilled in bursts of REFILL, a few KiB of requests that
    never block on a socket buffer the server's answers fill."""
    sent = 0
    first = min(len(requests), QUEUE_DEPTH)
    if first:
        await client.send(*requests[:first])
        sent = first
    for i in range(len(requests)):
        resp = await client.receive()
        if sent < len(requests) and client.in_flight <= QUEUE_DEPTH - REFILL:
            more = requests[sent:sent + QUEUE_DEPTH - client.in_flight]
            await client.send(*more)
            sent += len(more)
        on_answer(i, resp)


@attrs.define
class _Job:
    """One fork's pages to compare (blocks 0..n-1 on both sides)."""

    fork: Fork
    kind: str
    mask: MaskFn
    where: str


async def compare_snapshot(client: PageClient, snap: Snapshot,
                           only: Callable[[Fork], bool] | None = None) -> SnapshotResult:
    """Every fork and SLRU segment of ``snap`` against the pageserver at its LSN.

    All forks' existence and sizes are asked for in one pipelined round, then every page of
    every fork in one stream of GetPage requests (QUEUE_DEPTH in flight), each compared with
    the file's page (read in bulk per fork) as its answer arrives."""
    started = time.monotonic()
    res = SnapshotResult(snap.label, format_lsn(snap.lsn))
    req_lsn = MAX_LSN if snap.latest else snap.lsn
    at = f"{'latest' if snap.latest else 'LSN'} {format_lsn(snap.lsn)}"
    listed = list_forks(snap)
    if only is None:
        # every relation the catalogs name has its file (an unlogged one its init fork): the
        # files compared are all of them, also where they are a standby's
        have = {(f.rel.dbnode, f.rel.relnode, f.rel.forknum) for f in listed}
        for (db, relnode), info in sorted(snap.rels.items()):
            forknum = {"p": 0, "u": 3}.get(info.persistence)
            if forknum is not None and (db, relnode, forknum) not in have:
                res.mismatches.append(f"{info.name} ({db}/{relnode}) fork {FORK_NAMES[forknum]}: named by "
                                      f"pg_class, no file in {snap.root}")
    forks: list[Fork] = []
    for fork in listed:
        if only is not None and not only(fork):
            continue
        if fork.info is not None and fork.info.persistence == "t":
            continue  # temporary relations are local to their backend
        if fork.info is not None and fork.info.persistence == "u" and fork.rel.forknum != 3:
            res.skipped_unlogged_forks += 1
            continue
        forks.append(fork)
    res.forks = len(forks)
    exists = [isinstance(r, ExistsResponse) and r.exists for r in await _answers(
        client, [ExistsRequest(client.next_reqid(), req_lsn, snap.lsn, f.rel) for f in forks])]
    sized = [f for f, e in zip(forks, exists, strict=True) if e]
    sizes = {f.rel: r.n_blocks for f, r in zip(sized, await _answers(
        client, [NblocksRequest(client.next_reqid(), req_lsn, snap.lsn, f.rel) for f in sized]), strict=True)
        if isinstance(r, NblocksResponse)}
    files = _ForkFile(snap.root)
    jobs: list[_Job] = []
    requests: list[GetPageRequest] = []
    for fork in forks:
        served_n = sizes.get(fork.rel, 0)
        where = f"{fork.describe()} at {at}"
        if fork.info is None:
            if fork.nblocks == 0 and served_n == 0:
                res.nblocks_equal += 1
            else:
                res.mismatches.append(f"{where}: a {fork.nblocks}-block file pg_class does not know "
                                      f"(pageserver: {served_n} blocks)")
            continue
        fsm = fork.rel.forknum == 1
        if served_n == fork.nblocks:
            res.nblocks_equal += 1
        elif fsm:
            res.fsm_nblocks_differ += 1
        elif served_n > fork.nblocks:
            res.mismatches.append(f"{where}: nblocks {served_n} on the pageserver, {fork.nblocks} in the files")
        else:
            res.nblocks_file_longer += 1  # every block past served_n is checked to be new below
        kind, mask = _mask_for(fork)
        # past the pageserver's end: pages PostgreSQL extended without WAL
        for blkno in range(served_n, fork.nblocks):
            if fsm:
                continue
            local = files.block(fork.rel, blkno)
            ok = _empty_vm_page(local) if fork.rel.forknum == 2 else _is_zero(local)
            if ok:
                res.new_pages_past_end += 1
            else:
                res.mismatches.append(f"{where}: block {blkno} is past the pageserver's nblocks {served_n} "
                                      f"but not a new page ({BLCKSZ - local.count(0)} non-zero bytes)")
        job = _Job(fork, kind, mask, where)
        for blkno in range(min(served_n, fork.nblocks)):
            jobs.append(job)
            requests.append(GetPageRequest(client.next_reqid(), req_lsn, snap.lsn, fork.rel, blkno))

    def on_answer(i: int, resp: Response) -> None:
        job, blkno = jobs[i], requests[i].blkno
        _compare_page(snap, res, job, blkno, resp, files)

    await _stream(client, requests, on_answer)
    if only is None:
        await _compare_slru(client, snap, req_lsn, at, res)
    res.seconds = round(time.monotonic() - started, 2)
    return res


def _compare_page(snap: Snapshot, res: SnapshotResult, job: _Job, blkno: int, resp: Response,
                  files: _ForkFile) -> None:
    """One served page against the file's, counted in ``res`` under the fork's kind."""
    fork, kind, mask, where = job.fork, job.kind, job.mask, job.where
    fsm = fork.rel.forknum == 1
    if isinstance(resp, ErrorResponse):
        res.mismatches.append(f"{where}: block {blkno}: GetPage failed: {resp.message}")
        if not fsm:
            res.pages[kind] += 1
            res.unreadable[kind] += 1
            res.unreadable_reasons[_reason(resp.message)] += 1
        return
    assert isinstance(resp, GetPageResponse)
    served = bytes(resp.page)
    local = files.block(fork.rel, blkno)
    if fsm:
        res.fsm_pages += 1
        res.fsm_equal += served == local
        return
    res.pages[kind] += 1
    note = ""
    if _is_zero(served) and _is_zero(local):
        diff = 0
    elif kind == "vm" and _is_zero(served) and _empty_vm_page(local):
        diff = 0  # a VM page read as new is an empty one (vm_readbuf)
    elif kind == "spgist" and blkno == 0 and snap.reference is not None and _spgist_meta_as_postgres(
            served, local, _reference_block(snap.reference, fork.rel, blkno), mask):
        diff = 0
        res.spgist_meta_as_postgres += 1
    elif kind == "sequence":
        assert fork.info is not None
        diff, note = compare_sequence(served, local, fork.info.seq_increment)
        if diff == 0 and served != local and _masked(served, blkno, mask) != _masked(local, blkno, mask):
            res.sequences_logged_ahead += 1
    else:
        a, b = _masked(served, blkno, mask), _masked(local, blkno, mask)
        if isinstance(a, bytes) and isinstance(b, bytes):
            diff = _diff(a, b)
        else:
            diff = _diff(served, local)
            note = f"served: {a}" if isinstance(a, str) else f"file: {b!s}"
    if diff and kind == "vm" and snap.reference is not None and _vm_lost_as_postgres(
            served, local, _reference_block(snap.reference, fork.rel, blkno)):
        # bits no redo can rebuild from WAL: exactly PostgreSQL's own redo's page
        diff = 0
        res.vm_bits_lost_as_postgres += 1
    if diff == 0:
        res.equal[kind] += 1
    else:
        res.different[kind] += 1
        res.mismatches.append(f"{where}: block {blkno}: {diff} bytes differ after the {kind} mask"
                              + (f" ({note})" if note else ""))


async def _compare_slru(client: PageClient, snap: Snapshot, req_lsn: Lsn, at: str, res: SnapshotResult) -> None:
    for kind, sub in SLRU_DIRS.items():
        d = snap.root / sub
        for f in sorted(d.iterdir()):
            if not re.fullmatch(r"[0-9A-F]{4,}", f.name):
                continue
            segno = int(f.name, 16)
            local = f.read_bytes()
            res.slru_segments += 1
            try:
                served = await client.slru_segment(kind, segno, req_lsn, snap.lsn)
            except Exception as exc:
                res.mismatches.append(f"{sub}/{f.name} at {at}: GetSlruSegment failed: {exc}")
                continue
            if len(served) != len(local):
                res.mismatches.append(f"{sub}/{f.name} at {at}: {len(served)} bytes served, {len(local)} in the file")
                continue
            for off in range(0, len(local), BLCKSZ):
                res.slru_pages += 1
                a, b = served[off:off + BLCKSZ], local[off:off + BLCKSZ]
                diff = _diff(a, b)
                if diff:
                    first = next(i for i in range(BLCKSZ) if a[i] != b[i])
                    word = first // 4 * 4
                    res.mismatches.append(
                        f"{sub}/{f.name} page {off // BLCKSZ} at {at}: {diff} bytes differ, the first in u32 "
                        f"{word // 4} (byte {word}): served {a[word:word + 4].hex()}, file {b[word:word + 4].hex()}")
                else:
                    res.slru_equal += 1


# -- the workload --------------------------------------------------------------------------------


@attrs.frozen
class OracleOptions:
    workdir: Path
    scale: int = 5
    duration_s: float = 60.0
    clients: int = 2
    safekeepers: int = 3
    consistency_checking: bool = True  # wal_consistency_checking = all in the workload sessions
    workload_rows: int = 1200  # size of the btree workload (the others scale with it)


def _wcc(conn: psycopg.Connection[Any], on: bool) -> None:
    conn.execute(f"SET wal_consistency_checking = '{'all' if on else ''}'")


def workload_a(conn: psycopg.Connection[Any], conn2: psycopg.Connection[Any], rows: int) -> None:
    """Btree splits and new roots, deletes + VACUUM, HOT and non-HOT updates, multixacts."""
    x = conn.execute
    # 200-byte random keys: a fan-out of ~35, so ``rows`` inserts make a level-2 root.
    x("CREATE TABLE o_bt (k text, v int)")
    x("CREATE INDEX o_bt_k ON o_bt (k)")
    x("CREATE INDEX o_bt_v ON o_bt (v)")
    x("INSERT INTO o_bt SELECT repeat(md5(random()::text), 6) || g, g FROM generate_series(1, %s) g", (rows,))
    x("INSERT INTO o_bt SELECT repeat(md5(g::text), 6), g + %s FROM generate_series(1, %s) g", (rows, rows // 4))
    # Deletes: a contiguous v range empties whole o_bt_v leaves (page deletion), the tail lets
    # VACUUM truncate the heap (Storage/TRUNCATE), every third row leaves holes everywhere.
    x("DELETE FROM o_bt WHERE v BETWEEN %s AND %s", (rows // 5, rows // 2))
    x("DELETE FROM o_bt WHERE v > %s", (rows + rows // 8,))
    x("DELETE FROM o_bt WHERE v % 3 = 0")
    x("VACUUM o_bt")
    x("CREATE TABLE o_upd (id int PRIMARY KEY, a int, b text) WITH (fillfactor = 70)")
    x("INSERT INTO o_upd SELECT g, g, md5(g::text) FROM generate_series(1, %s) g", (rows,))
    x("UPDATE o_upd SET b = b || 'x' WHERE id % 5 = 0")  # HOT
    x("UPDATE o_upd SET id = id + 1000000 WHERE id % 7 = 0")  # non-HOT: key changes
    x("UPDATE o_upd SET b = repeat(b, 8) WHERE id % 11 = 0")  # non-HOT: no room left
    x("DELETE FROM o_upd WHERE id % 13 = 0")
    x("VACUUM o_upd")
    # Multixacts: two sessions share-lock the same rows, then one updates under a key-share lock.
    conn.autocommit = conn2.autocommit = False
    try:
        x("SELECT id FROM o_upd WHERE id <= 40 FOR SHARE")
        conn2.execute("SELECT id FROM o_upd WHERE id <= 60 FOR SHARE")
        conn2.execute("SELECT id FROM o_upd WHERE id BETWEEN 100 AND 140 FOR KEY SHARE")
        conn.commit()
        x("UPDATE o_upd SET a = -a WHERE id BETWEEN 100 AND 120")
        conn.commit()
        conn2.commit()
    finally:
        conn.autocommit = conn2.autocommit = True


def workload_b(conn: psycopg.Connection[Any], rows: int) -> None:
    """Sequences, TOAST, CREATE INDEX, TRUNCATE, subtransactions with rollbacks, unlogged."""
    x = conn.execute
    x("CREATE SEQUENCE o_seq")
    x("CREATE SEQUENCE o_seq_by7 INCREMENT 7 START 100")
    x("SELECT nextval('o_seq') FROM generate_series(1, 75)")
    x("SELECT nextval('o_seq_by7') FROM generate_series(1, 5)")
    x("CREATE TABLE o_ident (id bigint GENERATED ALWAYS AS IDENTITY, t text)")
    x("INSERT INTO o_ident (t) SELECT g::text FROM generate_series(1, 40) g")
    x("CREATE TABLE o_toast (id int, t text)")
    x("ALTER TABLE o_toast ALTER COLUMN t SET STORAGE EXTERNAL")
    x("INSERT INTO o_toast SELECT g, repeat(md5(g::text), 200 + g) FROM generate_series(1, %s) g", (max(8, rows // 60),))
    x("UPDATE o_toast SET t = t || 'tail' WHERE id % 3 = 0")
    x("DELETE FROM o_toast WHERE id % 4 = 0")
    x("CREATE INDEX o_upd_a ON o_upd (a)")
    x("CREATE INDEX o_toast_id ON o_toast (id)")
    x("CREATE TABLE o_trunc (id int PRIMARY KEY, t text)")
    x("INSERT INTO o_trunc SELECT g, md5(g::text) FROM generate_series(1, %s) g", (rows,))
    x("TRUNCATE o_trunc")
    x("INSERT INTO o_trunc SELECT g, md5(g::text) FROM generate_series(1, %s) g", (rows // 3,))
    conn.autocommit = False
    try:
        x("TRUNCATE o_trunc")
        x("INSERT INTO o_trunc VALUES (1, 'rolled back')")
        conn.rollback()
        # Subtransactions: rollbacks, releases, and more than 64 of them (XACT_ASSIGNMENT).
        x("CREATE TABLE o_sub (id int, t text)")
        for i in range(80):
            x(f"SAVEPOINT s{i}")
            x("INSERT INTO o_sub VALUES (%s, 'sub')", (i,))
            if i % 3 == 0:
                x(f"ROLLBACK TO SAVEPOINT s{i}")
            elif i % 3 == 1:
                x(f"RELEASE SAVEPOINT s{i}")
        conn.commit()
        x("INSERT INTO o_sub VALUES (-1, 'aborted top')")
        x("SAVEPOINT a")
        x("INSERT INTO o_sub VALUES (-2, 'aborted sub')")
        conn.rollback()
    finally:
        conn.autocommit = True
    x("CREATE UNLOGGED TABLE o_unlogged (id int PRIMARY KEY, t text)")
    x("INSERT INTO o_unlogged SELECT g, md5(g::text) FROM generate_series(1, 500) g")


def workload_c(conn: psycopg.Connection[Any], rows: int) -> None:
    """After the last copy: change pages the copies hold, so @LSN must find the old versions."""
    x = conn.execute
    x("UPDATE o_upd SET a = a + 1 WHERE id % 4 = 1")
    x("DELETE FROM o_bt WHERE v % 5 = 1")
    x("VACUUM o_bt")
    x("SELECT nextval('o_seq') FROM generate_series(1, 40)")
    x("TRUNCATE o_toast")
    x("INSERT INTO o_toast SELECT g, repeat(md5(g::text), 300) FROM generate_series(1, 5) g")
    x("VACUUM FREEZE o_upd")
    x("VACUUM pgbench_history")


@attrs.frozen
class OracleCluster:
    """A running local cluster with one tenant and its primary endpoint ``main``."""

    env: LocalEnv
    tenant: str
    timeline: str
    port: int
    pgdata: Path


@contextmanager
def oracle_cluster(workdir: Path, safekeepers: int, storage: str = "full") -> Iterator[OracleCluster]:
    """Start a cluster (free ports, no fsync on the safekeepers, ``validate_redo`` on), a
    tenant and its primary endpoint; stop everything at once on the way out. The endpoint is
    ``full`` unless told: its files are then PostgreSQL's own, the oracle (a lazy endpoint's
    are the pageserver's pages)."""
    cfg = attrs.evolve(plan_ports(safekeepers, free_ports=True),
                       safekeeper_no_sync=True, validate_redo=True)
    env = LocalEnv.create(workdir, cfg)
    quiet: Callable[[str], None] = lambda _msg: None  # noqa: E731
    try:
        cluster.start(env, log=quiet)
        t = cluster.create_tenant(env, None, None, set_default=True)
        ep = endpoint.start_endpoint(env, "main", storage=storage, log=quiet)
        yield OracleCluster(env, t["tenant_id"], str(t["timeline_id"]), ep.spec.port, ep.pgdata)
    finally:
        cluster.stop(env, immediate=True, log=quiet)


class Oracle:
    """One run: cluster, workload with checkpoints and copies, comparisons, teardown."""

    def __init__(self, opts: OracleOptions, emit: Callable[[dict[str, Any]], None]) -> None:
        self.opts = opts
        self.emit = emit
        self.env: LocalEnv | None = None
        self.snapshots: list[Snapshot] = []
        self.results: list[SnapshotResult] = []
        self.tenant = ""
        self.timeline = ""
        self.port = 0
        self.pgdata = Path()
        self.copies = Path()
        self.validation: dict[str, float] = {}
        self.self_check: list[str] = []

    def dsn(self, db: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={postgres.PG_USER} dbname={db}"

    @contextmanager
    def cluster(self) -> Iterator[LocalEnv]:
        with oracle_cluster(self.opts.workdir, self.opts.safekeepers) as oc:
            self.env, self.tenant, self.timeline = oc.env, oc.tenant, oc.timeline
            self.port, self.pgdata = oc.port, oc.pgdata
            yield oc.env

    def pgbench(self, *args: str) -> str:
        return postgres.PostgresInstance(self.pgdata, port=self.port, started=True).pgbench(*args)

    def checkpoint(self, conn: psycopg.Connection[Any], label: str, *, copy: bool) -> Snapshot:
        """Pause point: catalogs, CHECKPOINT, the insert LSN, the pageserver there, a copy."""
        assert self.env is not None
        rels = catalog_rels(self.dsn)  # before the CHECKPOINT: catalog reads may prune pages
        conn.execute("SELECT pg_current_wal_insert_lsn()")
        conn.execute("CHECKPOINT")
        row = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        assert row is not None
        lsn = parse_lsn(str(row[0]))
        cluster.wait_for_lsn(self.env, self.tenant, self.timeline, lsn, timeout=600)
        root = self.pgdata
        if copy:
            root = self.copies / label
            for sub in ("global", "base", "pg_xact", "pg_multixact"):
                shutil.copytree(self.pgdata / sub, root / sub)
        snap = Snapshot(label, lsn, root, rels, latest=not copy)
        self.emit({"checkpoint": label, "lsn": format_lsn(lsn), "relations": len(rels)})
        return snap

    def run(self) -> list[SnapshotResult]:
        opts = self.opts
        self.copies = Path(tempfile.mkdtemp(prefix="oracle-copies-", dir=opts.workdir.parent))
        try:
            with self.cluster():
                self._workload()
                trio.run(self._compare_all)
        finally:
            shutil.rmtree(self.copies, ignore_errors=True)
        return self.results

    def _workload(self) -> None:
        opts = self.opts
        rows = opts.workload_rows
        with psycopg.connect(self.dsn(), autocommit=True) as conn, \
                psycopg.connect(self.dsn(), autocommit=True) as conn2:
            # No worker may change a page between a CHECKPOINT and the copy of the files.
            conn.execute("ALTER SYSTEM SET autovacuum = off")
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 60
            while _autovacuum_workers(conn):
                if time.monotonic() > deadline:
                    raise RuntimeError("autovacuum workers still running 60 s after autovacuum = off")
                time.sleep(0.2)
            conn.execute("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # to read its pg_class
            t0 = time.monotonic()
            self.pgbench("-i", "-s", str(opts.scale), "-q")
            self.emit({"phase": "pgbench -i", "scale": opts.scale, "seconds": round(time.monotonic() - t0, 1)})
            self.snapshots.append(self.checkpoint(conn, "after-init", copy=True))
            half = max(1, int(opts.duration_s / 2))
            bench = ("-n", "-c", str(opts.clients), "-j", str(opts.clients), "-T", str(half))
            out = self.pgbench(*bench)
            self.emit({"phase": "pgbench", "seconds": half, "tps": _tps(out)})
            for c in (conn, conn2):
                _wcc(c, opts.consistency_checking)
            t0 = time.monotonic()
            workload_a(conn, conn2, rows)
            self.emit({"phase": "workload a", "seconds": round(time.monotonic() - t0, 1)})
            self.snapshots.append(self.checkpoint(conn, "after-workload-a", copy=True))
            out = self.pgbench(*bench)
            self.emit({"phase": "pgbench", "seconds": half, "tps": _tps(out)})
            t0 = time.monotonic()
            workload_b(conn, rows)
            self.emit({"phase": "workload b", "seconds": round(time.monotonic() - t0, 1)})
            self.snapshots.append(self.checkpoint(conn, "after-workload-b", copy=True))
            t0 = time.monotonic()
            self.pgbench("-n", "-c", str(opts.clients), "-t", "50")
            workload_c(conn, rows)
            self.emit({"phase": "workload c", "seconds": round(time.monotonic() - t0, 1)})
            self.snapshots.append(self.checkpoint(conn, "final", copy=False))

    async def _compare_all(self) -> None:
        assert self.env is not None
        async with await PageClient.connect("127.0.0.1", self.env.config.pageserver.pg,
                                            TenantId.parse(self.tenant), TimelineId.parse(self.timeline),
                                            **self.env.page_client_auth(self.tenant)) as client:
            for snap in [self.snapshots[-1], *self.snapshots[:-1]]:
                res = await compare_snapshot(client, snap)
                self.results.append(res)
                self.emit(res.as_json())
            self.self_check = await self._self_check(client)
            self.emit({"self_check": self.self_check})
        self.validation = await trio.to_thread.run_sync(self.validation_counts)
        self.emit({"redo_validation": self.validation})

    async def _self_check(self, client: PageClient) -> list[str]:
        """The comparison can fail: one byte flipped in a heap block, a btree block and a CLOG
        page of the first copy must come back as exactly those mismatches."""
        snap = self.snapshots[0]
        by_name = {info.name: key for key, info in snap.rels.items()}
        targets = []
        for name, heap in (("postgres.pgbench_accounts", True), ("postgres.pgbench_accounts_pkey", False)):
            db, relnode = by_name[name]
            rel = RelTag(DEFAULTTABLESPACE_OID, db, relnode, 0)
            path = snap.root / "base" / str(db) / str(relnode)
            with open(path, "r+b") as f:  # block 1, the first data byte of item 1
                f.seek(BLCKSZ)
                page = bytearray(f.read(BLCKSZ))
                item = bp.get_itemid(page, 1) & 0x7FFF
                pos = item + (page[item + 22] if heap else 8)
                f.seek(BLCKSZ + pos)
                f.write(bytes([page[pos] ^ 0xFF]))
            targets.append(rel)
        clog = snap.root / "pg_xact" / "0000"
        data = bytearray(clog.read_bytes())
        data[100] ^= 0x0F
        clog.write_bytes(bytes(data))
        found: list[str] = []
        res = await compare_snapshot(client, snap, only=lambda fork: fork.rel in targets)
        found += res.mismatches
        slru = SnapshotResult(snap.label, format_lsn(snap.lsn))
        await _compare_slru(client, snap, snap.lsn, f"LSN {format_lsn(snap.lsn)}", slru)
        found += slru.mismatches
        return found

    def validation_counts(self) -> dict[str, float]:
        """The pageserver's redo validation counters (read while it runs)."""
        assert self.env is not None
        with urllib.request.urlopen(f"{self.env.pageserver_http}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pageserver_walredo_validation_") and "_total " in line:
                name, value = line.split()
                out[name] = float(value)
        return out


def _autovacuum_workers(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'").fetchone()
    return int(row[0]) if row else 0


def _tps(out: str) -> float | None:
    m = re.search(r"tps = ([0-9.]+)", out)
    return float(m.group(1)) if m else None


def run_oracle(opts: OracleOptions, emit: Callable[[dict[str, Any]], None] | None = None) -> Oracle:
    """Run the whole check; the returned Oracle holds ``results``, ``validation`` (the
    pageserver's redo validation counters) and ``self_check`` (the planted mismatches found)."""
    oracle = Oracle(opts, emit or (lambda d: print(json.dumps(d), flush=True)))
    oracle.run()
    return oracle


# -- CLI -------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=int, default=5, help="pgbench scale factor (default 5)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of pgbench in total (default 60)")
    parser.add_argument("--clients", type=int, default=2, help="pgbench clients (default 2)")
    parser.add_argument("--rows", type=int, default=1200, help="rows of the btree workload (default 1200)")
    parser.add_argument("--no-consistency-checking", action="store_true",
                        help="workload sessions without wal_consistency_checking (no redo validation)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the throwaway cluster lives (default: a new directory in /tmp)")


def run(args: argparse.Namespace) -> int:
    with postgres.postgres_tmpdir("pagestore-oracle-") as base:
        workdir = args.workdir or base / "cluster"
        opts = OracleOptions(workdir=workdir, scale=args.scale, duration_s=args.duration, clients=args.clients,
                             consistency_checking=not args.no_consistency_checking, workload_rows=args.rows)
        started = time.monotonic()
        oracle = run_oracle(opts)
    results, validation = oracle.results, oracle.validation
    bad = sum(len(r.mismatches) for r in results)
    pages = sum(sum(r.pages.values()) for r in results)
    print(json.dumps({"result": "ok" if bad == 0 else "MISMATCH", "snapshots": len(results), "pages": pages,
                      "equal": sum(sum(r.equal.values()) for r in results),
                      "slru_pages": sum(r.slru_pages for r in results), "mismatches": bad,
                      "validation": validation, "self_check_found": len(oracle.self_check),
                      "seconds": round(time.monotonic() - started, 1)}), flush=True)
    for r in results:
        for m in r.mismatches[:50]:
            print(f"MISMATCH {m}", file=sys.stderr)
    return 0 if bad == 0 and len(oracle.self_check) == 3 else 1
