"""GIN and BRIN pages for ``pagestore bench redo``'s rebuild rows (source ``gin-brin``).

A throwaway PostgreSQL 15 (production-sized records: no consistency-checking images) fills
indexes created empty: a btree on text (the reference), a GIN posting tree, GIN entry leaves
with and without posting lists in the tuples, a GIN pending list, BRIN minmax-multi with one
page per range. ``histories`` replays every page of those indexes once to learn each record's
"page before"; ``windows`` cuts a page's chain into runs of N consecutive records of one kind,
which ``bench.redo`` rebuilds and times next to the btree leaf's.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from compute.postgres import PostgresInstance
from pageserver.walredo.manager import PostgresRedoManager, RelBlock, record_name
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal
from protocol.lsn import parse_lsn
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


# (label, index, record name prefix, which pages of that index); the first is the reference
KINDS: list[tuple[str, str, str, Callable[[bytes], bool]]] = [
    ("btree leaf", "bt_k", "Btree/INSERT_LEAF", lambda p: True),
    ("gin posting leaf", "gp_a", "Gin/INSERT", lambda p: _gin_flags(p) & 3 == 3),
    ("gin entry leaf, posting lists in tuples", "gp_a", "Gin/INSERT", lambda p: _gin_flags(p) & 3 == 2),
    ("gin entry leaf", "ge_a", "Gin/INSERT", lambda p: _gin_flags(p) & 3 == 2),
    ("gin pending-list tail", "gf_a", "Gin/UPDATE_META_PAGE", lambda p: bool(_gin_flags(p) & 0x10)),
    ("brin regular page", "br_v", "BRIN/", lambda p: _brin_type(p) == 0xF093),
    ("brin revmap page", "br_v", "BRIN/", lambda p: _brin_type(p) == 0xF092),
]


def generate(base: Path) -> tuple[list[DecodedRecord], dict[str, int]]:
    """The workload's WAL records and the relfilenode of each index of ``KINDS``."""
    pg = PostgresInstance.create(base / "gin-brin", settings={**VERIFY_SETTINGS, "wal_consistency_checking": ""})
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


def histories(records: list[DecodedRecord], nodes: set[int]) -> dict[RelBlock, list[tuple[bytes | None, DecodedRecord]]]:
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


def windows(chain: list[tuple[bytes | None, DecodedRecord]], n: int, prefix: str) -> list[tuple[bytes, list[DecodedRecord]]]:
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
