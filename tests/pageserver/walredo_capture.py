"""Shared by the SP-GiST and GiST redo tests: run SQL on a real PostgreSQL 15 that logs a
verification image on every block reference, and hand back the WAL and the data files.

``capture`` starts a fresh cluster (``VERIFY_SETTINGS``: wal_consistency_checking = all, no
autovacuum, every segment kept), CHECKPOINTs, runs the statements, CHECKPOINTs again so the
data files are final, and returns the decoded records of the run plus a reader for the
relation files, before the cluster is removed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

from compute.postgres import PostgresInstance
from pageserver.walredo import bufpage as bp
from pageserver.walredo.manager import RelBlock
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol.lsn import parse_lsn
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
