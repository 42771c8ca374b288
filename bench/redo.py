"""``pagestore bench redo``: how fast the pure-Python redo replays real PostgreSQL WAL.

A throwaway PostgreSQL 15 (``wal_consistency_checking = 'all'``, so every block reference
carries the page after the change and every page has a known "before") runs pgbench, a few
btree/VACUUM statements, and one workload per index access method on indexes created empty
and then filled, updated, deleted from and vacuumed (hash, GIN with and without the pending
list, GiST, SP-GiST, BRIN, and bloom for generic WAL). Then, from that WAL:

- per record type: µs per record of ``decode_record`` + ``PostgresRedoManager.redo_page`` on
  one page (validation off), i.e. the cost the read path pays per stored record; a record
  type the redo cannot replay yet is reported as ``unsupported`` (with the error);
- reconstruct, per page kind (heap, btree, hash, gin, gist, spgist, brin, generic): the time
  ``PostgresRedoManager.apply`` (the storage engine's entry point, raw stored records) takes
  to rebuild the page of that kind with the longest chain from its image plus its first
  10 / 100 / 1000 records, and the ratio to the btree page with as many records in the same
  run; ``slow`` is true where that ratio is above 3.

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

# One workload per index access method: created empty, then filled (splits), updated, deleted
# from and vacuumed, so its record types arrive as incremental WAL.
AM_WORKLOAD = [
    # a btree leaf with a chain of over 1000 records: duplicates stay on the root leaf (dedup)
    "CREATE TABLE am_b (id int, v int)",
    "CREATE INDEX am_b_v ON am_b (v)",
    "INSERT INTO am_b SELECT g, 1 FROM generate_series(1, 1500) g",
    "CREATE TABLE am_h (id int, v int)",
    "CREATE INDEX am_h_v ON am_h USING hash (v)",
    "INSERT INTO am_h SELECT g, g % 5 FROM generate_series(1, 3000) g",  # one bucket page, long chains
    "INSERT INTO am_h SELECT g, g FROM generate_series(1, 20000) g",  # bucket splits, overflow pages
    "DELETE FROM am_h WHERE id % 3 = 0",
    "VACUUM am_h",
    "CREATE TABLE am_g (id int, a int[])",
    "CREATE INDEX am_g_a ON am_g USING gin (a) WITH (fastupdate = off)",
    "INSERT INTO am_g SELECT g, ARRAY[g % 7, g % 11, 1000 + g] FROM generate_series(1, 4000) g",
    "CREATE TABLE am_gf (id int, a int[])",
    "CREATE INDEX am_gf_a ON am_gf USING gin (a) WITH (fastupdate = on)",
    "INSERT INTO am_gf SELECT g, ARRAY[g % 13, g] FROM generate_series(1, 3000) g",
    "DELETE FROM am_g WHERE id % 4 = 0",
    "VACUUM am_g",
    "VACUUM am_gf",
    "CREATE TABLE am_gs (id int, p point)",
    "CREATE INDEX am_gs_p ON am_gs USING gist (p)",
    "INSERT INTO am_gs SELECT g, point(g % 100, g / 100) FROM generate_series(1, 8000) g",
    "DELETE FROM am_gs WHERE id % 3 = 0",
    "VACUUM am_gs",
    "CREATE TABLE am_sp (id int, p point, t text)",
    "CREATE INDEX am_sp_p ON am_sp USING spgist (p)",
    "CREATE INDEX am_sp_t ON am_sp USING spgist (t)",
    "INSERT INTO am_sp SELECT g, point(g % 97, g % 89), md5(g::text) FROM generate_series(1, 8000) g",
    "DELETE FROM am_sp WHERE id % 3 = 0",
    "VACUUM am_sp",
    # every insert widens the one summary tuple of the last range: a long chain on one page
    "CREATE TABLE am_br1 (id int, v int)",
    "CREATE INDEX am_br1_v ON am_br1 USING brin (v)",
    "INSERT INTO am_br1 SELECT g, g FROM generate_series(1, 1500) g",
    "CREATE TABLE am_br (id int, v int)",
    "CREATE INDEX am_br_v ON am_br USING brin (v) WITH (pages_per_range = 1)",
    "INSERT INTO am_br SELECT g, g FROM generate_series(1, 30000) g",
    "UPDATE am_br SET v = -v WHERE id % 50 = 0",
    "VACUUM am_br",
    "SELECT brin_summarize_new_values('am_br_v')",
    "CREATE EXTENSION IF NOT EXISTS bloom",
    "CREATE TABLE am_bl (id int, a int, b int)",
    "CREATE INDEX am_bl_ab ON am_bl USING bloom (a, b)",
    "INSERT INTO am_bl SELECT g, g % 17, g % 29 FROM generate_series(1, 6000) g",
    "DELETE FROM am_bl WHERE id % 5 = 0",
    "VACUUM am_bl",
]
PAGE_KINDS = ("heap", "btree", "hash", "gin", "gist", "spgist", "brin", "generic")
SLOW_RATIO = 3.0
PAGE_KIND_QUERY = """
SELECT pg_relation_filenode(c.oid),
       CASE WHEN c.relkind IN ('r', 't', 'm') THEN 'heap'
            WHEN am.amname IN ('btree', 'hash', 'gin', 'gist', 'spgist', 'brin') THEN am.amname
            WHEN c.relkind = 'i' THEN 'generic' ELSE c.relkind::text END
FROM pg_class c LEFT JOIN pg_am am ON am.oid = c.relam
WHERE pg_relation_filenode(c.oid) IS NOT NULL
"""

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


def _generate(base: Path, transactions: int) -> tuple[PostgresInstance, int, int, dict[int, str]]:
    pg = PostgresInstance.create(base / "data", settings=VERIFY_SETTINGS)
    pg.start()
    pg.psql("CHECKPOINT")
    start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-t", str(transactions), "-c", "1")
    for sql in WORKLOAD + AM_WORKLOAD:
        pg.psql(sql)
    end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
    kinds = {}
    for line in pg.psql(PAGE_KIND_QUERY).splitlines():
        node, kind = line.split("|")
        kinds[int(node)] = kind
    return pg, start, end, kinds


Chains = dict[RelBlock, list[tuple[bytes, DecodedRecord]]]


def _cases(records: list[DecodedRecord]) -> tuple[dict[str, list[tuple[RelBlock, bytes, DecodedRecord]]], Chains,
                                                 dict[str, str]]:
    """Per record type: (page, page before, record); per page: the chain of records; per record
    type the redo cannot replay: the first error (that page's chain ends there)."""
    mgr = PostgresRedoManager()
    pages: dict[RelBlock, bytearray | None] = {}
    by_type: dict[str, list[tuple[RelBlock, bytes, DecodedRecord]]] = defaultdict(list)
    chains: Chains = defaultdict(list)
    unsupported: dict[str, str] = {}
    for rec in records:
        for blk in rec.blocks:
            t = RelBlock(blk.spc, blk.db, blk.rel, blk.forknum, blk.blkno)
            if t in pages and pages[t] is None:
                continue  # an earlier record of this page could not be replayed
            cur = pages.get(t)
            if cur is None and not blk.apply_image and not blk.will_init:
                if blk.image is not None:
                    page = bytearray(blk.image)
                    bp.page_set_lsn(page, rec.end_lsn)
                    pages[t] = page
                continue
            before = bytes(cur) if cur is not None else b""
            try:
                new = mgr.redo_page(t, cur, rec)
            except Exception as exc:  # a resource manager or record type without redo yet
                unsupported.setdefault(record_name(rec), f"{type(exc).__name__}: {exc}"[:200])
                pages[t] = None
                continue
            if new is None:
                continue
            pages[t] = new
            by_type[record_name(rec)].append((t, before, rec))
            chains[t].append((before, rec))
    return by_type, chains, unsupported


def _rebuild_ms(mgr: PostgresRedoManager, t: RelBlock, chain: list[tuple[bytes, DecodedRecord]], n: int,
                repeat: int) -> float:
    key = Key(rel_block_key(t.spc, t.db, t.rel, t.fork, t.blkno))
    base_img = chain[0][0] or None
    values: list[tuple[Lsn, WalRecordValue]] = [
        (Lsn(rec.end_lsn), PostgresRecord(False, rec.raw)) for _before, rec in chain[:n]
    ]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        mgr.apply(key, base_img, values)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def reconstruct_by_kind(chains: Chains, kinds: dict[int, str], repeat: int) -> list[dict[str, object]]:
    """Per page kind and N: the page of that kind with the longest chain rebuilt from N records,
    with the ratio to the btree page of the same N (``slow`` above SLOW_RATIO)."""
    mgr = PostgresRedoManager()
    longest: dict[str, tuple[RelBlock, list[tuple[bytes, DecodedRecord]]]] = {}
    for t, chain in chains.items():
        kind = kinds.get(t.rel)
        if t.fork != 0 or kind not in PAGE_KINDS:
            continue
        if kind not in longest or len(chain) > len(longest[kind][1]):
            longest[kind] = (t, chain)
    out: list[dict[str, object]] = []
    for n in (10, 100, 1000):
        timed: dict[str, float] = {}
        for kind in PAGE_KINDS:  # interleaved: every kind of one N timed back to back
            if kind in longest and len(longest[kind][1]) >= n:
                t, chain = longest[kind]
                timed[kind] = _rebuild_ms(mgr, t, chain, n, repeat)
        btree = timed.get("btree")
        for kind in PAGE_KINDS:
            row: dict[str, object] = {"bench": "redo", "kind": "reconstruct", "page_kind": kind, "records": n}
            if kind not in timed:
                have = len(longest[kind][1]) if kind in longest else 0
                row["skipped"] = f"longest chain of a {kind} page has {have} records"
            else:
                t, chain = longest[kind]
                row["ms"] = round(timed[kind], 3)
                row["us_per_record"] = round(timed[kind] * 1e3 / n, 1)
                row["vs_btree"] = round(timed[kind] / btree, 2) if btree else None
                row["slow"] = bool(btree and timed[kind] > SLOW_RATIO * btree)
                row["record_types"] = sorted({record_name(rec) for _b, rec in chain[:n]})
            out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    with postgres_tmpdir("pagestore-bench-redo-") as base:
        pg, start, end, kinds = _generate(base, args.transactions)
        try:
            records = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
    by_type, chains, unsupported = _cases(records)
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
        }), flush=True)
    for name, error in sorted(unsupported.items()):
        print(json.dumps({"bench": "redo", "kind": "record_type", "type": name, "unsupported": error}), flush=True)
    for row in reconstruct_by_kind(chains, kinds, args.repeat):
        print(json.dumps(row), flush=True)
    return 0
