"""Shared by the GIN and BRIN redo tests: capture real WAL from the installed PostgreSQL 15,
replay it with ``verify_records`` and compare the rebuilt index pages with the data files.

``capture`` runs SQL on a fresh cluster with ``wal_consistency_checking = 'all'`` (every
block reference of every record carries the page as the primary left it), then CHECKPOINTs
and copies the data files of the named relations, so the cluster can go away before the
assertions run. ``rebuild_pages`` replays the records the way GetPage does (per block, from
nothing, the raw records ingest stores), and ``compare_with_file`` checks the result against
the data file. Record sub-kinds that the record name alone does not tell apart (GIN INSERT on
an entry leaf, an internal entry page, a posting leaf...) are counted by ``gin_kinds``.
"""

from __future__ import annotations

import random
import struct
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs

from compute.postgres import PostgresInstance
from pageserver.storage.value import PostgresRecord, WalRecordValue
from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from pageserver.walredo.gin_posting import parse_actions
from pageserver.walredo.manager import PostgresRedoManager, RedoStats, RelBlock
from pageserver.walredo.mask import masked
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol.lsn import parse_lsn
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import RmgrId
from tests.pageserver.index_redo import ingest_and_read
from tests.tmpdirs import pg_tmpdir

SETTINGS = {**VERIFY_SETTINGS, "shared_buffers": "32MB", "wal_compression": "lz4"}


@attrs.define
class Capture:
    records: list[DecodedRecord]
    # relation name -> (relfilenode, file bytes at the end of the run)
    files: dict[str, tuple[int, bytes]]
    seconds: float


def capture(sql: Sequence[str], relations: Iterable[str]) -> Capture:
    with pg_tmpdir("pagestore-ginbrin-") as base:
        pg = PostgresInstance.create(base / "data", settings=SETTINGS)
        try:
            pg.start()
            pg.psql("CHECKPOINT")
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            t0 = time.monotonic()
            for stmt in sql:
                pg.psql(stmt)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            seconds = time.monotonic() - t0
            pg.psql("CHECKPOINT")
            files = {}
            for name in relations:
                path = pg.psql(f"SELECT pg_relation_filepath('{name}')")
                node = int(pg.psql(f"SELECT pg_relation_filenode('{name}')"))
                files[name] = (node, Path(pg.datadir / path).read_bytes())
            records = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
    return Capture(records, files, seconds)


def rebuild_pages(records: Iterable[DecodedRecord], node: int) -> tuple[dict[int, bytes], RedoStats, list[str]]:
    """Every main-fork page of relfilenode ``node`` rebuilt from nothing the way GetPage does it:
    the raw records stored under each block they reference (as WAL ingest stores them),
    replayed oldest first by a fresh redo manager. Returns the pages, the manager's counts of
    applied records per type, and the errors of pages that could not be rebuilt."""
    per_block: dict[RelBlock, list[tuple[int, WalRecordValue]]] = defaultdict(list)
    for rec in records:
        for blk in rec.blocks:
            if blk.rel == node and blk.forknum == 0:
                t = RelBlock(blk.spc, blk.db, blk.rel, 0, blk.blkno)
                per_block[t].append((rec.end_lsn, PostgresRecord(blk.will_init or blk.apply_image, rec.raw)))
    mgr = PostgresRedoManager(count=True)
    pages: dict[int, bytes] = {}
    errors = []
    for t, values in per_block.items():
        try:
            pages[t.blkno] = mgr.apply_to_target(t, None, values)
        except RedoError as exc:
            errors.append(f"block {t.blkno}: {exc}")
    return pages, mgr.stats, errors


def compare_with_file(
    pages: dict[int, bytes], data: bytes, mask: Callable[[bytearray, int], None]
) -> tuple[int, list[str]]:
    """Every block of the file was rebuilt and equals the file page (both masked)."""
    problems = []
    nblocks = len(data) // bp.BLCKSZ
    for blkno in range(nblocks):
        disk = data[blkno * bp.BLCKSZ : (blkno + 1) * bp.BLCKSZ]
        page = pages.get(blkno)
        if page is None:
            problems.append(f"block {blkno} was not rebuilt")
        elif masked(page, blkno, mask) != masked(disk, blkno, mask):
            problems.append(f"block {blkno} differs from the data file")
    return nblocks, problems


# --- GIN record sub-kinds -------------------------------------------------------------------

_ACTION_NAMES = {1: "DELETE", 2: "INSERT", 3: "REPLACE", 4: "ADDITEMS"}


def gin_kinds(records: Iterable[DecodedRecord]) -> Counter[str]:
    """GIN records by what they did, e.g. ``INSERT entry internal``, ``SPLIT data root``,
    ``leaf action ADDITEMS`` (counted per recompression action in WAL block data)."""
    kinds: Counter[str] = Counter()
    for rec in records:
        if rec.xl_rmid != RmgrId.GIN:
            continue
        info = rec.xl_info & 0xF0
        b0 = rec.block(0)
        if info == 0x20:  # INSERT
            (flags,) = struct.unpack_from("<H", rec.main_data, 0)
            tree = "data" if flags & 1 else "entry"
            level = "leaf" if flags & 2 else "internal"
            kind = f"INSERT {tree} {level}"
            if b0 is not None and b0.data:
                if tree == "entry" and level == "leaf" and b0.data[2]:
                    kind += " replace"
                if tree == "data" and level == "leaf":
                    for _segno, action, _p in parse_actions(b0.data):
                        kinds[f"leaf action {_ACTION_NAMES[action]}"] += 1
            if level == "internal" and rec.block(1) is not None:
                kinds["INSERT child split finished"] += 1
            kinds[kind] += 1
        elif info == 0x30:  # SPLIT
            (flags,) = struct.unpack_from("<H", rec.main_data, 24)
            tree = "data" if flags & 1 else "entry"
            level = "leaf" if flags & 2 else "internal"
            kinds[f"SPLIT {tree} {level}{' root' if flags & 4 else ''}"] += 1
        elif info == 0x90 and b0 is not None and b0.data:  # VACUUM_DATA_LEAF_PAGE
            for _segno, action, _p in parse_actions(b0.data):
                kinds[f"vacuum action {_ACTION_NAMES[action]}"] += 1
        elif info == 0x60:  # UPDATE_META_PAGE
            (ntuples,) = struct.unpack_from("<i", rec.main_data, 80)
            (prev_tail,) = struct.unpack_from("<I", rec.main_data, 72)
            kinds["UPDATE_META_PAGE " + ("tail insert" if ntuples > 0 else "new sublist" if prev_tail != 0xFFFFFFFF else "meta only")] += 1
    return kinds


def brin_kinds(records: Iterable[DecodedRecord]) -> Counter[str]:
    """BRIN records by name, plus ``REVMAP_EXTEND over a regular page`` (the revmap took
    over a block that held summaries: the primary evacuated it first with UPDATEs)."""
    kinds: Counter[str] = Counter()
    regular: set[tuple[int, int]] = set()
    for rec in records:
        if rec.xl_rmid != RmgrId.BRIN:
            continue
        kinds[rec.record_type] += 1
        info = rec.xl_info & 0x70
        b0 = rec.block(0)
        if info in (0x10, 0x20) and b0 is not None:
            regular.add((b0.rel, b0.blkno))
        elif info == 0x40:
            b1 = rec.block(1)
            if b1 is not None and (b1.rel, b1.blkno) in regular:
                kinds["REVMAP_EXTEND over a regular page"] += 1
    return kinds


# --- hostile variants of real records -------------------------------------------------------


def truncations(rec: DecodedRecord, bid: int) -> list[tuple[str, DecodedRecord]]:
    """The record with its main data, or block ``bid``'s data, cut short."""
    blk = next(b for b in rec.blocks if b.block_id == bid)
    out = []
    main = rec.main_data
    for n in sorted({0, 1, 2, len(main) // 2, len(main) - 1}):
        if 0 <= n < len(main):
            out.append((f"main data cut to {n} of {len(main)}", attrs.evolve(rec, main_data=main[:n])))
    for n in sorted({0, 1, 3, 4, 7, len(blk.data) // 2, len(blk.data) - 1}):
        if 0 <= n < len(blk.data):
            blocks = tuple(attrs.evolve(b, data=b.data[:n]) if b.block_id == bid else b for b in rec.blocks)
            out.append((f"block {bid} data cut to {n} of {len(blk.data)}", attrs.evolve(rec, blocks=blocks)))
    return out


def garblings(rec: DecodedRecord, bid: int, rng: random.Random, n: int = 3) -> list[tuple[str, DecodedRecord]]:
    """The record with a few random bytes of its main data or block ``bid``'s data changed."""
    blk = next(b for b in rec.blocks if b.block_id == bid)
    out = []
    for _ in range(n):
        if blk.data and (not rec.main_data or rng.random() < 0.7):
            data = bytearray(blk.data)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            blocks = tuple(attrs.evolve(b, data=bytes(data)) if b.block_id == bid else b for b in rec.blocks)
            out.append((f"block {bid} data garbled", attrs.evolve(rec, blocks=blocks)))
        elif rec.main_data:
            main = bytearray(rec.main_data)
            main[rng.randrange(len(main))] = rng.randrange(256)
            out.append(("main data garbled", attrs.evolve(rec, main_data=bytes(main))))
    return out


def replay_variants(
    records: Iterable[DecodedRecord], rmid: int, per_kind: int = 4
) -> list[tuple[DecodedRecord, str, BaseException | None]]:
    """Replay ``records`` page by page; before the first ``per_kind`` redone blocks of each
    (record type, block id) of resource manager ``rmid``, replay each truncation and a few
    garblings of the record on a copy of the page instead. Returns (record, variant,
    exception or None)."""
    mgr = PostgresRedoManager()
    rng = random.Random(16)
    pages: dict[RelBlock, bytearray] = {}
    seen: Counter[tuple[str, int]] = Counter()
    out: list[tuple[DecodedRecord, str, BaseException | None]] = []
    for rec in records:
        if rec.xl_rmid not in (rmid, RmgrId.XLOG):  # index pages start from XLOG images
            continue
        for blk in rec.blocks:
            t = RelBlock(blk.spc, blk.db, blk.rel, blk.forknum, blk.blkno)
            cur = pages.get(t)
            if cur is None and not (blk.apply_image or blk.will_init):
                continue
            kind = (rec.record_type, blk.block_id)
            if rec.xl_rmid == rmid and not blk.apply_image and seen[kind] < per_kind:
                seen[kind] += 1
                for what, bad in truncations(rec, blk.block_id) + garblings(rec, blk.block_id, rng):
                    try:
                        mgr.redo_page(t, None if cur is None else bytearray(cur), bad)
                    except Exception as exc:
                        out.append((rec, what, exc))
                    else:
                        out.append((rec, what, None))
            try:
                new = mgr.redo_page(t, cur, rec)
            except RedoError:
                pages.pop(t, None)
                continue
            if new is not None:
                pages[t] = new
    return out


# --- through WAL ingest ---------------------------------------------------------------------


def ingest_then_read(
    tmp_path: Path, records: Sequence[DecodedRecord], nodes: Iterable[int], rmid: int
) -> tuple[list[str], dict[int, dict[int, bytes]]]:
    """Feed the records of relfilenodes ``nodes`` through WAL ingest into a fresh timeline (as
    the safekeepers' stream would), then read every block at the last LSN twice: once with
    resource manager ``rmid``'s redo taken out (what a pageserver without it stored and
    served), once with it, from the same stored values. Returns the errors of the first read
    and the pages of the second, per relfilenode (``index_redo.ingest_and_read`` does the work)."""
    nodes = set(nodes)
    mine = [r for r in records if r.blocks and all(b.rel in nodes for b in r.blocks)]
    errors, pages = ingest_and_read(tmp_path, mine, nodes, unsupported=rmid, forks=(0,), validate=False)
    out: dict[int, dict[int, bytes]] = {node: {} for node in nodes}
    for blk, page in pages.items():
        out[blk.rel][blk.blkno] = bytes(page)
    return errors, out
