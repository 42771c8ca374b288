"""Rebuild time of GiST and SP-GiST pages next to a btree page with the same number of records.

``pagestore bench redo-index`` starts a throwaway PostgreSQL 15 (wal_level replica,
no consistency-checking images: production-sized records) with one table and three indexes
created empty on it: btree (int), GiST (point), SP-GiST (point, quad tree). A few rounds of
"insert 120 rows, delete them, VACUUM" keep each index's root a leaf page, so one page per
index collects a long chain of its access method's insert records plus a vacuum per round.
For each index, ``PostgresRedoManager.apply`` (the storage engine's entry point: decode the
stored raw record, replay it) rebuilds that page from the chain's first N records, N = 10 /
100 / 1000; best of ``--repeat``. One JSON line per (index, N), with the ratio to btree.
Run it next to nothing else heavy: the three kinds are timed in the same run, interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from compute.postgres import PostgresInstance, postgres_tmpdir
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import PostgresRecord, WalRecordValue
from pageserver.walredo.manager import PostgresRedoManager, record_name
from pageserver.walredo.verify import read_wal
from protocol.lsn import Lsn, parse_lsn
from protocol.wal.record import DecodedRecord

SETTINGS = {
    "wal_level": "replica", "autovacuum": "off", "fsync": "off", "synchronous_commit": "off",
    "wal_keep_size": "1GB", "max_wal_size": "1GB", "checkpoint_timeout": "1h",
}
INDEXES = {"btree": "t_b", "gist": "t_g", "spgist": "t_s"}
ROOT = {"btree": 1, "gist": 0, "spgist": 1}  # the root leaf page of each kind


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


def run(args: argparse.Namespace) -> int:
    with postgres_tmpdir("pagestore-bench-idx-") as base:
        pg = PostgresInstance.create(base / "data", settings=SETTINGS)
        try:
            pg.start()
            pg.psql("CHECKPOINT")
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            _workload(pg, args.rounds)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            nodes = {am: int(pg.psql(f"SELECT relfilenode FROM pg_class WHERE relname = '{ix}'")) for am, ix in INDEXES.items()}
            records = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
    mgr = PostgresRedoManager()
    chains = {am: _chain(records, nodes[am], ROOT[am]) for am in INDEXES}
    for n in (10, 100, 1000):
        best = dict.fromkeys(INDEXES, float("inf"))
        values: dict[str, list[tuple[Lsn, WalRecordValue]]] = {}
        keys: dict[str, Key] = {}
        for am, chain in chains.items():
            if len(chain) < n:
                print(json.dumps({"bench": "redo_index", "am": am, "records": n, "skipped": f"chain has {len(chain)}"}))
                continue
            b0 = next(b for b in chain[0].blocks if b.rel == nodes[am] and b.blkno == ROOT[am])
            keys[am] = Key(rel_block_key(b0.spc, b0.db, b0.rel, 0, b0.blkno))
            values[am] = [(Lsn(r.end_lsn), PostgresRecord(i == 0, r.raw)) for i, r in enumerate(chain[:n])]
        for _ in range(args.repeat):
            for am in values:  # interleaved, so load changes hit every kind alike
                t0 = time.perf_counter()
                mgr.apply(keys[am], None, values[am])
                best[am] = min(best[am], time.perf_counter() - t0)
        for am in values:
            types = sorted({record_name(r) for r in chains[am][:n]})
            line = {
                "bench": "redo_index", "am": am, "records": n, "ms": round(best[am] * 1e3, 3),
                "us_per_record": round(best[am] / n * 1e6, 1), "record_types": types,
            }
            if "btree" in values:
                line["ratio_to_btree"] = round(best[am] / best["btree"], 2)
            print(json.dumps(line))
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=10, help="insert/delete/VACUUM rounds (120 rows each)")
    parser.add_argument("--repeat", type=int, default=5, help="timing repetitions (best is kept)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
