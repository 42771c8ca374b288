"""GiST and SP-GiST pages for ``pagestore bench redo``'s rebuild rows (source ``gist-spgist``).

A throwaway PostgreSQL 15 (wal_level replica, no consistency-checking images:
production-sized records) with one table and three indexes created empty on it: btree (int,
the reference), GiST (point), SP-GiST (point, quad tree). Rounds of "insert 120 rows, delete
them, VACUUM" keep each index's root a leaf page, so one page per index collects a long chain
of its access method's insert records plus a vacuum per round; ``bench.redo`` rebuilds each
root from its chain's first N records.
"""

from __future__ import annotations

from pathlib import Path

from compute.postgres import PostgresInstance
from pageserver.walredo.manager import RelBlock
from pageserver.walredo.verify import read_wal
from protocol.lsn import parse_lsn
from protocol.wal.record import DecodedRecord

SETTINGS = {
    "wal_level": "replica", "autovacuum": "off", "fsync": "off", "synchronous_commit": "off",
    "wal_keep_size": "1GB", "max_wal_size": "1GB", "checkpoint_timeout": "1h",
}
INDEXES = {"btree": "t_b", "gist": "t_g", "spgist": "t_s"}
ROOT = {"btree": 1, "gist": 0, "spgist": 1}  # the root leaf page of each kind
ROUNDS = 10  # insert/delete/VACUUM rounds of 120 rows


def _workload(pg: PostgresInstance, rounds: int) -> None:
    pg.psql("CREATE TABLE t (id int, p point)")
    pg.psql("CREATE INDEX t_b ON t (id)")
    pg.psql("CREATE INDEX t_g ON t USING gist (p)")
    pg.psql("CREATE INDEX t_s ON t USING spgist (p)")
    for r in range(rounds):
        pg.psql(f"INSERT INTO t SELECT g, point(g % 17 + {r}, g % 13) FROM generate_series(1, 120) g")
        pg.psql("DELETE FROM t")
        pg.psql("VACUUM t")


def _chain(records: list[DecodedRecord], relfilenode: int, blkno: int) -> list[DecodedRecord]:
    """The records on one page since the last one that starts it (image or init)."""
    chain: list[DecodedRecord] = []
    for r in records:
        for b in r.blocks:
            if b.rel == relfilenode and b.forknum == 0 and b.blkno == blkno:
                if b.apply_image or b.will_init:
                    chain = []
                chain.append(r)
    return chain


def generate(base: Path, rounds: int = ROUNDS) -> dict[str, tuple[RelBlock, list[DecodedRecord]]]:
    """Per access method, its root leaf and the chain of records on it."""
    pg = PostgresInstance.create(base / "gist-spgist", settings=SETTINGS)
    try:
        pg.start()
        pg.psql("CHECKPOINT")
        start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        _workload(pg, rounds)
        end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        nodes = {am: int(pg.psql(f"SELECT relfilenode FROM pg_class WHERE relname = '{ix}'")) for am, ix in INDEXES.items()}
        records = list(read_wal(pg.wal_dir(), start, end))
    finally:
        pg.destroy()
    out: dict[str, tuple[RelBlock, list[DecodedRecord]]] = {}
    for am in INDEXES:
        chain = _chain(records, nodes[am], ROOT[am])
        if chain:
            b0 = next(b for b in chain[0].blocks if b.rel == nodes[am] and b.forknum == 0 and b.blkno == ROOT[am])
            out[am] = (RelBlock(b0.spc, b0.db, b0.rel, 0, b0.blkno), chain)
    return out
