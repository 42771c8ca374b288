"""Shared by the SP-GiST and GiST redo tests: run SQL on a real PostgreSQL 15 that logs a
verification image on every block reference, and hand back the WAL and the data files.

``capture`` starts a fresh cluster (``VERIFY_SETTINGS``: wal_consistency_checking = all, no
autovacuum, every segment kept), CHECKPOINTs, runs the statements, CHECKPOINTs again so the
data files are final, and returns the decoded records of the run plus a reader for the
relation files, before the cluster is removed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import trio

from compute.postgres import PostgresInstance
from pageserver.pg_control import CheckPoint
from pageserver.pgdatadir import Datadir, RelTag
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import SLRU_CLOG
from pageserver.storage.value import Image, PostgresRecord
from pageserver.tenant import Tenant
from pageserver.walingest import WalIngest
from pageserver.walredo import bufpage as bp
from pageserver.walredo.manager import PostgresRedoManager, RelBlock
from pageserver.walredo.mask import MaskFn, masked
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, parse_lsn
from protocol.wal.record import DecodedRecord
from tests.tmpdirs import pg_tmpdir


@attrs.define
class Capture:
    records: list[DecodedRecord]
    start: int
    end: int
    # relfilenode -> (relation name, access method) for the relations the SQL made
    rels: dict[int, tuple[str, str]]
    pages: dict[RelBlock, bytes]  # every page of those relations' main forks, after CHECKPOINT
    seconds: float


def _rel_path(datadir: Path, db: int, rel: int) -> Path:
    return datadir / "base" / str(db) / str(rel)


@contextmanager
def _cluster(settings: dict[str, str]) -> Iterator[PostgresInstance]:
    with pg_tmpdir("pagestore-redo-idx-") as base:
        pg = PostgresInstance.create(base / "data", settings=settings)
        try:
            pg.start()
            yield pg
        finally:
            pg.destroy()


def capture(
    statements: Sequence[str | Callable[[PostgresInstance], None]],
    *,
    settings: dict[str, str] | None = None,
) -> Capture:
    with _cluster({**VERIFY_SETTINGS, "shared_buffers": "64MB", **(settings or {})}) as pg:
        pg.psql("CHECKPOINT")
        start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        t0 = time.monotonic()
        for st in statements:
            if isinstance(st, str):
                pg.psql(st)
            else:
                st(pg)
        end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        seconds = time.monotonic() - t0
        pg.psql("CHECKPOINT")
        db = int(pg.psql("SELECT oid FROM pg_database WHERE datname = current_database()"))
        rows = pg.psql(
            "SELECT c.relfilenode, c.relname, coalesce(a.amname, 'heap') FROM pg_class c"
            " LEFT JOIN pg_am a ON a.oid = c.relam WHERE c.relnamespace = 'public'::regnamespace"
            " AND c.relfilenode <> 0"
        )
        rels: dict[int, tuple[str, str]] = {}
        for line in rows.splitlines():
            if line.strip():
                relfilenode, name, am = line.split("|")
                rels[int(relfilenode)] = (name, am)
        pages: dict[RelBlock, bytes] = {}
        for node in rels:
            data = _rel_path(pg.datadir, db, node).read_bytes()
            for blkno in range(len(data) // bp.BLCKSZ):
                pages[RelBlock(1663, db, node, 0, blkno)] = data[blkno * bp.BLCKSZ : (blkno + 1) * bp.BLCKSZ]
        records = list(read_wal(pg.wal_dir(), start, end))
    return Capture(records, start, end, rels, pages, seconds)


def rels_of(c: Capture, am: str) -> set[int]:
    return {node for node, (_name, kind) in c.rels.items() if kind == am}


def records_touching(c: Capture, rels: set[int]) -> list[DecodedRecord]:
    return [r for r in c.records if any(b.rel in rels for b in r.blocks)]


def per_block(c: Capture, rels: set[int]) -> dict[RelBlock, list[tuple[int, PostgresRecord]]]:
    """What WAL ingest stores: the raw record under each main-fork block it references."""
    out: dict[RelBlock, list[tuple[int, PostgresRecord]]] = {}
    for r in c.records:
        for b in r.blocks:
            if b.rel in rels and b.forknum == 0:
                t = RelBlock(b.spc, b.db, b.rel, 0, b.blkno)
                out.setdefault(t, []).append((r.end_lsn, PostgresRecord(b.will_init or b.apply_image, r.raw)))
    return out


def compare_with_files(
    c: Capture, rebuilt: dict[RelBlock, bytes], rels: set[int], mask: MaskFn, *, skip_block0: bool = False
) -> int:
    """Every data-file page of ``rels`` equals its rebuilt page (masked); returns how many
    were compared. A page no record names must be new (extended without WAL): storage gives
    zeros there too."""
    compared = 0
    for t, disk in c.pages.items():
        if t.rel not in rels:
            continue
        if t not in rebuilt:
            assert disk == bytes(bp.BLCKSZ), f"page {t} of the data files was not rebuilt"
            continue
        if skip_block0 and t.blkno == 0:
            continue
        assert masked(rebuilt[t], t.blkno, mask) == masked(disk, t.blkno, mask), f"{t} differs"
        compared += 1
    return compared


def bare_checkpoint() -> CheckPoint:
    return CheckPoint(
        redo=Lsn(0), this_timeline_id=1, prev_timeline_id=1, full_page_writes=True,
        next_xid=3, next_oid=16384, next_multi=1, next_multi_offset=0, oldest_xid=3,
        oldest_xid_db=1, oldest_multi=1, oldest_multi_db=1, time=0, oldest_commit_ts_xid=0,
        newest_commit_ts_xid=0, oldest_active_xid=0,
    )


def ingest_and_read(
    c: Capture,
    tmp_path: Path,
    targets: Sequence[RelBlock],
    before_reads: Callable[[Datadir, Lsn], Awaitable[None]] | None = None,
    rels: set[int] | None = None,
) -> dict[RelBlock, bytes]:
    """Feed the run's records through ``WalIngest`` into a fresh timeline and read ``targets``
    back through ``Datadir.get_page`` at the last record (``before_reads`` runs first). With
    ``rels``, only the records that touch those relations or no relation at all are fed (the
    rest change other pages only)."""
    db = targets[0].db
    out: dict[RelBlock, bytes] = {}

    async def run() -> None:
        config = StorageConfig(validate_get=True, double_buffering=False)
        tenant = Tenant(tmp_path, TenantId.generate(), config, redo=PostgresRedoManager())
        tl = await tenant.create_timeline(TimelineId.generate())
        ing = WalIngest(tl)
        mod = ing.w.begin(Lsn(c.start))
        mod.put_checkpoint(bare_checkpoint())
        await mod.put_dbdir_creation(1663, db)
        await mod.put_slru_segment_creation(SLRU_CLOG, 0, 1)
        await mod.put_slru_page(SLRU_CLOG, 0, 0, Image(bytes(bp.BLCKSZ)))
        await mod.commit()
        for r in c.records:
            if rels is None or not r.blocks or any(b.rel in rels for b in r.blocks):
                await ing.ingest_record(r)
        lsn = tl.last_record_lsn
        dd = Datadir(tl)
        if before_reads is not None:
            await before_reads(dd, lsn)
        for t in targets:
            out[t] = await dd.get_page(RelTag(t.spc, t.db, t.rel, t.fork), t.blkno, lsn)
        await tenant.shutdown()

    trio.run(run)
    return out
