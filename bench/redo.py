"""``pagestore bench redo``: how fast the pure-Python redo replays real PostgreSQL WAL.

A throwaway PostgreSQL 15 (``wal_consistency_checking = 'all'``, so every block reference
carries the page after the change and every page has a known "before") runs pgbench and a
few btree/VACUUM statements. Then, from that WAL:

- per record type: records/s of ``decode_record`` + ``PostgresRedoManager.redo_page`` on one
  page (validation off), i.e. the cost the read path pays per stored record;
- reconstruct: the time ``PostgresRedoManager.apply`` (the storage engine's entry point, raw
  stored records) takes to rebuild one page from an image plus 10 / 100 / 1000 records. The
  chain is the pgbench_branches page, updated by every transaction.

Prints one JSON object per line. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from compute.postgres import PostgresInstance, postgres_tmpdir
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import PostgresRecord, WalRecordValue
from pageserver.walredo import bufpage as bp
from pageserver.walredo.manager import PostgresRedoManager, RelBlock, record_name
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol.lsn import Lsn, parse_lsn
from protocol.wal.record import DecodedRecord, decode_record

WORKLOAD = [
    "CREATE TABLE b (id int PRIMARY KEY, v text)",
    "INSERT INTO b SELECT g, md5(g::text) FROM generate_series(1, 5000) g",
    "CREATE TABLE w (k text)",
    "CREATE INDEX w_k ON w (k)",
    "INSERT INTO w SELECT lpad(md5(random()::text), 700, 'r') FROM generate_series(1, 400)",
    "DELETE FROM b WHERE id % 3 = 0",
    "UPDATE b SET v = v || 'u' WHERE id % 7 = 0",
    "VACUUM b",
    "VACUUM FREEZE b",
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transactions", type=int, default=1200, help="pgbench -t (1 client)")
    parser.add_argument("--repeat", type=int, default=3, help="timing repetitions (best is kept)")


def _generate(base: Path, transactions: int) -> tuple[PostgresInstance, int, int]:
    pg = PostgresInstance.create(base / "data", settings=VERIFY_SETTINGS)
    pg.start()
    pg.psql("CHECKPOINT")
    start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-t", str(transactions), "-c", "1")
    for sql in WORKLOAD:
        pg.psql(sql)
    end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
    return pg, start, end


def _cases(records: list[DecodedRecord]) -> tuple[dict[str, list[tuple[RelBlock, bytes, DecodedRecord]]], dict[RelBlock, list[tuple[bytes, DecodedRecord]]]]:
    """Per record type: (page, page before, record); per page: the chain of records."""
    mgr = PostgresRedoManager()
    pages: dict[RelBlock, bytearray] = {}
    by_type: dict[str, list[tuple[RelBlock, bytes, DecodedRecord]]] = defaultdict(list)
    chains: dict[RelBlock, list[tuple[bytes, DecodedRecord]]] = defaultdict(list)
    for rec in records:
        for blk in rec.blocks:
            t = RelBlock(blk.spc, blk.db, blk.rel, blk.forknum, blk.blkno)
            cur = pages.get(t)
            if cur is None and not blk.apply_image and not blk.will_init:
                if blk.image is not None:
                    page = bytearray(blk.image)
                    bp.page_set_lsn(page, rec.end_lsn)
                    pages[t] = page
                continue
            before = bytes(cur) if cur is not None else b""
            new = mgr.redo_page(t, cur, rec)
            if new is None:
                continue
            pages[t] = new
            by_type[record_name(rec)].append((t, before, rec))
            chains[t].append((before, rec))
    return by_type, chains


def run(args: argparse.Namespace) -> int:
    with postgres_tmpdir("pagestore-bench-redo-") as base:
        pg, start, end = _generate(base, args.transactions)
        try:
            records = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
    by_type, chains = _cases(records)
    mgr = PostgresRedoManager()
    for name, cases in sorted(by_type.items()):
        cases = cases[:2000]
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for t, before, rec in cases:
                dec = decode_record(rec.raw, rec.lsn, rec.end_lsn)
                mgr.redo_page(t, bytearray(before) if before else None, dec)
            best = min(best, time.perf_counter() - t0)
        print(json.dumps({
            "bench": "redo", "kind": "record_type", "type": name, "records": len(cases),
            "records_per_s": round(len(cases) / best), "us_per_record": round(best / len(cases) * 1e6, 1),
        }))
    # the longest chain of one heap page (pgbench_branches: every transaction updates it)
    t, chain = max(((t, c) for t, c in chains.items() if t.fork == 0), key=lambda kv: len(kv[1]))
    key = Key(rel_block_key(t.spc, t.db, t.rel, t.fork, t.blkno))
    for n in (10, 100, 1000):
        if len(chain) < n:
            print(json.dumps({"bench": "redo", "kind": "reconstruct", "records": n, "skipped": f"chain has {len(chain)}"}))
            continue
        base_img = chain[0][0] or None
        values: list[tuple[Lsn, WalRecordValue]] = [
            (Lsn(rec.end_lsn), PostgresRecord(False, rec.raw)) for _before, rec in chain[:n]
        ]
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            mgr.apply(key, base_img, values)
            best = min(best, time.perf_counter() - t0)
        types = sorted({record_name(rec) for _b, rec in chain[:n]})
        print(json.dumps({
            "bench": "redo", "kind": "reconstruct", "records": n, "ms": round(best * 1e3, 3),
            "records_per_s": round(n / best), "record_types": types,
        }))
    return 0
