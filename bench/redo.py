"""``pagestore bench redo``: how fast the pure-Python redo replays real PostgreSQL WAL.

One command for every redo benchmark. Three throwaway PostgreSQL 15 servers write the WAL:

- ``suite``: ``wal_consistency_checking = 'all'`` (every block reference carries the page
  after the change, so every record has a known "page before") running pgbench, a few
  btree/VACUUM statements and one workload per index access method on indexes created empty
  and then filled, updated, deleted from and vacuumed (hash, GIN with and without the pending
  list, GiST, SP-GiST, BRIN, and bloom for generic WAL);
- ``gin-brin`` (``bench.redo_pages``): production-sized records into a btree on text, GIN
  posting trees, GIN entry leaves with and without posting lists, a GIN pending list, BRIN
  minmax-multi with one page per range;
- ``gist-spgist`` (``bench.redo_gist_spgist``): a btree, a GiST and an SP-GiST index on one
  table whose roots stay leaves through rounds of insert, delete and VACUUM.

From that WAL:

- per record type (``suite``): µs per record of ``decode_record`` +
  ``PostgresRedoManager.redo_page`` on one page (validation off), the cost the read path pays
  per stored record, in CPU seconds of this process (best of ``--repeat`` over up to 2,000
  records of the type); a record type the redo cannot replay is reported ``unsupported``;
- rebuild rows, per page kind and N = 10 / 100 / 1000 records: the time
  ``PostgresRedoManager.apply`` (the storage engine's entry point: base image + raw stored
  records) takes to rebuild the page, next to a btree page of the same WAL with as many
  records. ``suite``: the page of each kind with the longest chain, its first N records;
  ``gin-brin``: up to five windows of N consecutive records of one kind on one page (median);
  ``gist-spgist``: each root leaf's first N records. Timed in CPU seconds of this process
  (``time.process_time``: the shared machine's load does not count), best of ``--repeat``, in
  ``--rounds`` rounds that time every row once each, interleaved; the ratio to the btree page
  is taken within each round and its median reported, ``slow`` where it is above 3 (the
  rule of issue 16: no page kind slower to rebuild than 3x a btree page with as many records).

Prints one JSON object per line, then every rebuild row side by side in one table on stderr.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

from bench import redo_gist_spgist, redo_pages
from compute.postgres import PostgresInstance, postgres_tmpdir
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import PostgresRecord, WalRecordValue
from pageserver.walredo import bufpage as bp
from pageserver.walredo.manager import PostgresRedoManager, RelBlock, record_name
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol._native import IMPL
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
    parser.add_argument("--repeat", type=int, default=3, help="timing repetitions per row and round (best is kept)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds over all rebuild rows (ratios to btree: the median is reported)")


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


RECORD_COUNTS = (10, 100, 1000)


@attrs.frozen
class RebuildCase:
    """One page rebuilt from a base image and N raw records (a window of its chain)."""

    key: Key
    base: bytes | None
    values: list[tuple[Lsn, WalRecordValue]]
    record_types: tuple[str, ...]


@attrs.frozen
class RebuildRow:
    """One row of the rebuild table: a page kind of one source at N records, timed as the
    median over its cases (windows) of each case's best; ``reference`` is the btree row of
    the same source and N that its ratio is taken to."""

    source: str
    page: str
    records: int
    cases: list[RebuildCase]
    reference: str


def _case(t: RelBlock, base: bytes | None, recs: Iterable[DecodedRecord], first_inits: bool = False) -> RebuildCase:
    recs = list(recs)
    return RebuildCase(
        Key(rel_block_key(t.spc, t.db, t.rel, t.fork, t.blkno)), base,
        [(Lsn(r.end_lsn), PostgresRecord(first_inits and i == 0, r.raw)) for i, r in enumerate(recs)],
        tuple(sorted({record_name(r) for r in recs})))


def suite_rows(chains: Chains, kinds: dict[int, str]) -> tuple[list[RebuildRow], list[dict[str, object]]]:
    """The ``suite`` rows: per page kind the page with the longest chain, its first N records."""
    longest: dict[str, tuple[RelBlock, list[tuple[bytes, DecodedRecord]]]] = {}
    for t, chain in chains.items():
        kind = kinds.get(t.rel)
        if t.fork != 0 or kind not in PAGE_KINDS:
            continue
        if kind not in longest or len(chain) > len(longest[kind][1]):
            longest[kind] = (t, chain)
    rows: list[RebuildRow] = []
    skipped: list[dict[str, object]] = []
    for n in RECORD_COUNTS:
        for kind in PAGE_KINDS:
            have = len(longest[kind][1]) if kind in longest else 0
            if have < n:
                skipped.append({"source": "suite", "page": kind, "records": n,
                                "skipped": f"longest chain of a {kind} page has {have} records"})
                continue
            t, chain = longest[kind]
            case = _case(t, chain[0][0] or None, (rec for _b, rec in chain[:n]))
            rows.append(RebuildRow("suite", kind, n, [case], "btree"))
    return rows, skipped


def gin_brin_rows(base: Path) -> tuple[list[RebuildRow], list[dict[str, object]]]:
    """The ``gin-brin`` rows (``bench.redo_pages``): up to five windows per kind and N."""
    records, nodes = redo_pages.generate(base)
    hist = redo_pages.histories(records, set(nodes.values()))
    rows: list[RebuildRow] = []
    skipped: list[dict[str, object]] = []
    for n in RECORD_COUNTS:
        for label, index, prefix, which in redo_pages.KINDS:
            windows = [(t, w_base, recs) for t, chain in hist.items() if t.rel == nodes[index]
                       for w_base, recs in redo_pages.windows(chain, n, prefix) if which(w_base)]
            if not windows:
                skipped.append({"source": "gin-brin", "page": label, "records": n, "skipped": "no such window"})
                continue
            picked = windows[:: max(1, len(windows) // 5)][:5]
            rows.append(RebuildRow("gin-brin", label, n, [_case(t, b, recs) for t, b, recs in picked],
                                   redo_pages.KINDS[0][0]))
    return rows, skipped


def gist_spgist_rows(base: Path) -> tuple[list[RebuildRow], list[dict[str, object]]]:
    """The ``gist-spgist`` rows (``bench.redo_gist_spgist``): each root leaf's first N records."""
    chains = redo_gist_spgist.generate(base)
    rows: list[RebuildRow] = []
    skipped: list[dict[str, object]] = []
    for n in RECORD_COUNTS:
        for am, (t, chain) in chains.items():
            if len(chain) < n:
                skipped.append({"source": "gist-spgist", "page": f"{am} root leaf", "records": n,
                                "skipped": f"chain has {len(chain)} records"})
                continue
            rows.append(RebuildRow("gist-spgist", f"{am} root leaf", n, [_case(t, None, chain[:n], first_inits=True)],
                                   "btree root leaf"))
    return rows, skipped


def _cpu_s(mgr_of: Callable[[], PostgresRedoManager], case: RebuildCase, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        mgr = mgr_of()
        t0 = time.process_time()
        mgr.apply(case.key, case.base, case.values)
        best = min(best, time.process_time() - t0)
    return best


def time_rows(rows: list[RebuildRow], rounds: int, repeat: int) -> list[dict[str, object]]:
    """Every row once per round (interleaved: a load spike hits all rows alike), each the
    median over its cases; ratios to the reference row of the same source, N and round."""
    times: dict[int, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for i, row in enumerate(rows):
            times[i].append(statistics.median(_cpu_s(PostgresRedoManager, c, repeat) for c in row.cases))
    ref = {(r.source, r.page, r.records): i for i, r in enumerate(rows)}
    out: list[dict[str, object]] = []
    for i, row in enumerate(rows):
        secs = statistics.median(times[i])
        line: dict[str, object] = {
            "bench": "redo", "impl": IMPL, "kind": "rebuild", "source": row.source, "page": row.page, "records": row.records,
            "windows": len(row.cases), "rounds": rounds, "ms": round(secs * 1e3, 3),
            "us_per_record": round(secs / row.records * 1e6, 1),
        }
        j = ref.get((row.source, row.reference, row.records))
        if j is not None:
            ratios = [a / b for a, b in zip(times[i], times[j], strict=True) if b > 0]
            if ratios:
                median = statistics.median(ratios)
                line["vs_btree"] = round(median, 2)
                line["vs_btree_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
                line["slow"] = median > SLOW_RATIO
        line["record_types"] = sorted({t for c in row.cases for t in c.record_types})
        out.append(line)
    return out


def table(lines: list[dict[str, object]]) -> str:
    """The rebuild rows side by side: one line per (source, page), the ratio to btree per N."""
    cells: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for ln in lines:
        key = (str(ln["source"]), str(ln["page"]))
        n = int(str(ln["records"]))
        if "skipped" in ln:
            cells[key].setdefault(n, "-")
        else:
            slow = " SLOW" if ln.get("slow") else ""
            cells[key][n] = f"{ln.get('vs_btree', '?')}x {ln['ms']}ms{slow}"
    head = f"{'source':<12} {'page':<42}" + "".join(f"{f'N={n}':>24}" for n in RECORD_COUNTS)
    body = [f"{src:<12} {page:<42}" + "".join(f"{c.get(n, '-'):>24}" for n in RECORD_COUNTS)
            for (src, page), c in cells.items()]
    title = f"rebuild time vs a btree page with as many records (slow: > {SLOW_RATIO:g}x), {IMPL} kernels"
    return "\n".join([title, head, *body])


def run(args: argparse.Namespace) -> int:
    with postgres_tmpdir("pagestore-bench-redo-") as base:
        pg, start, end, kinds = _generate(base, args.transactions)
        try:
            records = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
        gin_brin, skipped_gb = gin_brin_rows(base)
        gist_spgist, skipped_gs = gist_spgist_rows(base)
    by_type, chains, unsupported = _cases(records)
    mgr = PostgresRedoManager()
    for name, cases in sorted(by_type.items()):
        cases = cases[:2000]
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.process_time()
            for t, before, rec in cases:
                dec = decode_record(rec.raw, rec.lsn, rec.end_lsn)
                mgr.redo_page(t, bytearray(before) if before else None, dec)
            best = min(best, time.process_time() - t0)
        print(json.dumps({
            "bench": "redo", "impl": IMPL, "kind": "record_type", "type": name, "records": len(cases),
            "records_per_s": round(len(cases) / best), "us_per_record": round(best / len(cases) * 1e6, 1),
        }), flush=True)
    for name, error in sorted(unsupported.items()):
        print(json.dumps({"bench": "redo", "kind": "record_type", "type": name, "unsupported": error}), flush=True)
    suite, skipped_s = suite_rows(chains, kinds)
    lines = time_rows(suite + gin_brin + gist_spgist, args.rounds, args.repeat)
    for sk in skipped_s + skipped_gb + skipped_gs:
        lines.append({"bench": "redo", "kind": "rebuild", **sk})
    for line in lines:
        print(json.dumps(line), flush=True)
    print(table(lines), file=sys.stderr, flush=True)
    return 0
