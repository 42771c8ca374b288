"""``pagestore bench redo-pages``: rebuild time of GIN and BRIN pages against a btree leaf.

The rule this measures: no index page kind takes more than 3x as long to rebuild as a btree
leaf with the same number of records. A throwaway PostgreSQL 15 fills indexes created empty
(btree on text; GIN posting tree, GIN entry leaves with and without posting lists in the
tuples, a GIN pending list; BRIN minmax-multi with one page per range). From its WAL every
page of those indexes is replayed once to learn each record's "page before"; then, per page
kind and per N in 10 and 100 (1000 where a page has that many), windows of N consecutive
records of one kind on one page are rebuilt with ``PostgresRedoManager.apply`` (the storage
engine's entry point: base image + raw stored records), timed in CPU seconds of this process
(``time.process_time``: the shared machine's load does not count), best of ``--repeat``, median over up
to five windows, in ``--rounds`` rounds that time every kind once each. Prints one JSON line
per (kind, N): the median time and the median (and range) over the rounds of its ratio to the
btree leaf of the same N in the same round. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time
from collections import defaultdict
from collections.abc import Callable

from compute.postgres import PostgresInstance, postgres_tmpdir
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import PostgresRecord, WalRecordValue
from pageserver.walredo.manager import PostgresRedoManager, RelBlock, record_name
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol.lsn import Lsn, parse_lsn
from protocol.wal.record import DecodedRecord

WORKLOAD = [
    "CREATE TABLE bt (id int, k text)",
    "CREATE INDEX bt_k ON bt (k)",
    "CREATE TABLE gp (id int, a int[])",
    "CREATE INDEX gp_a ON gp USING gin (a) WITH (fastupdate = off)",
    "CREATE TABLE ge (id int, a text[])",
    "CREATE INDEX ge_a ON ge USING gin (a) WITH (fastupdate = off)",
    "CREATE TABLE gf (id int, a int[])",
    "CREATE INDEX gf_a ON gf USING gin (a) WITH (fastupdate = on)",
    "CREATE TABLE br (id int, v int) WITH (fillfactor = 10)",
    "CREATE INDEX br_v ON br USING brin (v int4_minmax_multi_ops) WITH (pages_per_range = 1)",
    "INSERT INTO bt SELECT g, md5(g::text) FROM generate_series(1, 3000) g",
    "INSERT INTO gp SELECT g, ARRAY[1] FROM generate_series(1, 4000) g",
    "INSERT INTO ge SELECT g, ARRAY[md5(g::text)] FROM generate_series(1, 3000) g",
    "INSERT INTO gf SELECT g, ARRAY[g % 5] FROM generate_series(1, 3000) g",
    "INSERT INTO br SELECT g, g FROM generate_series(1, 200) g",
    "SELECT brin_summarize_new_values('br_v')",
    "INSERT INTO br SELECT g, (g * 7919) % 10007 FROM generate_series(1, 1200) g",
]


def _gin_flags(page: bytes) -> int:
    v: int = struct.unpack_from("<H", page, 8190)[0]
    return v


def _brin_type(page: bytes) -> int:
    v: int = struct.unpack_from("<H", page, 8190)[0]
    return v


# (label, index, record name prefix, which pages of that index)
KINDS: list[tuple[str, str, str, Callable[[bytes], bool]]] = [
    ("btree leaf", "bt_k", "Btree/INSERT_LEAF", lambda p: True),
    ("gin posting leaf", "gp_a", "Gin/INSERT", lambda p: _gin_flags(p) & 3 == 3),
    ("gin entry leaf, posting lists in tuples", "gp_a", "Gin/INSERT", lambda p: _gin_flags(p) & 3 == 2),
    ("gin entry leaf", "ge_a", "Gin/INSERT", lambda p: _gin_flags(p) & 3 == 2),
    ("gin pending-list tail", "gf_a", "Gin/UPDATE_META_PAGE", lambda p: bool(_gin_flags(p) & 0x10)),
    ("brin regular page", "br_v", "BRIN/", lambda p: _brin_type(p) == 0xF093),
    ("brin revmap page", "br_v", "BRIN/", lambda p: _brin_type(p) == 0xF092),
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=5, help="timing repetitions per window (best is kept)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds over all page kinds (medians are reported)")


def _generate() -> tuple[list[DecodedRecord], dict[str, int]]:
    with postgres_tmpdir("pagestore-bench-redo-pages-") as base:
        pg = PostgresInstance.create(base / "data", settings={**VERIFY_SETTINGS, "wal_consistency_checking": ""})
        try:
            pg.start()
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            for sql in WORKLOAD:
                pg.psql(sql)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            nodes = {name: int(pg.psql(f"SELECT pg_relation_filenode('{name}')")) for _l, name, _r, _p in KINDS}
            records = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
    return records, nodes


def _histories(records: list[DecodedRecord], nodes: set[int]) -> dict[RelBlock, list[tuple[bytes | None, DecodedRecord]]]:
    """Per index page, each record with the page as it was before it (None: image or init)."""
    mgr = PostgresRedoManager()
    pages: dict[RelBlock, bytearray] = {}
    hist: dict[RelBlock, list[tuple[bytes | None, DecodedRecord]]] = defaultdict(list)
    for rec in records:
        for blk in rec.blocks:
            if blk.rel not in nodes or blk.forknum != 0:
                continue
            t = RelBlock(blk.spc, blk.db, blk.rel, 0, blk.blkno)
            cur = pages.get(t)
            if cur is None and not (blk.apply_image or blk.will_init):
                continue
            fresh = blk.apply_image or blk.will_init or cur is None
            before = None if fresh or cur is None else bytes(cur)
            new = mgr.redo_page(t, cur, rec)
            if new is not None:
                pages[t] = new
                hist[t].append((before, rec))
    return hist


def _windows(chain: list[tuple[bytes | None, DecodedRecord]], n: int, prefix: str) -> list[tuple[bytes, list[DecodedRecord]]]:
    out = []
    i = 0
    while i + n <= len(chain):
        w = chain[i : i + n]
        base = w[0][0]
        if base is not None and all(b is not None and record_name(r).startswith(prefix) for b, r in w):
            out.append((base, [r for _b, r in w]))
            i += n
        else:
            i += 1
    return out


def _time(t: RelBlock, base: bytes, recs: list[DecodedRecord], repeat: int) -> float:
    key = Key(rel_block_key(t.spc, t.db, t.rel, 0, t.blkno))
    values: list[tuple[Lsn, WalRecordValue]] = [(Lsn(r.end_lsn), PostgresRecord(False, r.raw)) for r in recs]
    best = float("inf")
    for _ in range(repeat):
        mgr = PostgresRedoManager()
        t0 = time.process_time()
        mgr.apply(key, base, values)
        best = min(best, time.process_time() - t0)
    return best


def run(args: argparse.Namespace) -> int:
    records, nodes = _generate()
    hist = _histories(records, set(nodes.values()))
    for n in (10, 100, 1000):
        picked: dict[str, list[tuple[RelBlock, bytes, list[DecodedRecord]]]] = {}
        for label, index, prefix, which in KINDS:
            cases = [
                (t, base, recs)
                for t, chain in hist.items() if t.rel == nodes[index]
                for base, recs in _windows(chain, n, prefix) if which(base)
            ]
            if cases:
                picked[label] = cases[:: max(1, len(cases) // 5)][:5]
            else:
                print(json.dumps({"bench": "redo-pages", "page": label, "records": n, "skipped": "no such window"}))
        # rounds: every kind once per round, so a load spike hits all of them alike; the ratio
        # to the btree leaf is taken within each round and its median reported
        times: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.rounds):
            for label, cases in picked.items():
                times[label].append(statistics.median(_time(t, base, recs, args.repeat) for t, base, recs in cases))
        btree = times.get("btree leaf")
        for label, ts in times.items():
            secs = statistics.median(ts)
            ratio = statistics.median(a / b for a, b in zip(ts, btree, strict=True)) if btree else None
            print(json.dumps({
                "bench": "redo-pages", "page": label, "records": n, "windows": len(picked[label]),
                "rounds": args.rounds, "ms": round(secs * 1e3, 3), "us_per_record": round(secs / n * 1e6, 1),
                "vs_btree_leaf": round(ratio, 2) if ratio is not None else None,
                "vs_btree_leaf_range": [round(min(a / b for a, b in zip(ts, btree, strict=True)), 2),
                                        round(max(a / b for a, b in zip(ts, btree, strict=True)), 2)] if btree else None,
            }))
    return 0
