"""Generic WAL redo (rmid 20) against the installed PostgreSQL 15, with contrib ``bloom``.

Bloom logs every change through generic WAL: full images at build, metapage init and new
pages; deltas for inserts (one page, or page + metapage) and VACUUM. One PostgreSQL runs with
``wal_consistency_checking = 'all'`` while bloom indexes are created empty and filled,
built over a loaded table, deleted from, vacuumed, refilled (pages on the metapage's
not-full list are reused), emptied, and built unlogged.

- each delta is replayed page by page and compared (generic_mask) with its verification
  image; full-image blocks, delta blocks and multi-block records must all have occurred;
- after a CHECKPOINT every rebuilt index page equals the file's page (masked), and so does
  every page read back after WAL ingest;
- hypothesis: random page edits encoded the way ``generic_xlog.c`` computes its delta
  (lower and upper regions against the old page, fragments closer than 5 bytes merged)
  replay to the new page;
- truncated or garbled deltas raise ``RedoError`` naming the record.
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.postgres import PostgresInstance
from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import RedoError
from pageserver.walredo.generic import apply_delta
from pageserver.walredo.manager import PostgresRedoManager, RelBlock
from pageserver.walredo.mask import generic_mask
from pageserver.walredo.verify import VERIFY_SETTINGS, VerifyReport, read_wal, verify_records
from protocol.lsn import parse_lsn
from protocol.wal.encoder import BlockSpec, build_record
from protocol.wal.record import DecodedRecord, RelFileNode, decode_record
from protocol.wal.rmgr import RmgrId
from tests.pageserver.index_redo import (
    Pages,
    compare_with_files,
    ingest_and_read,
    relfilenodes_of_am,
    unbuilt_blocks,
)
from tests.tmpdirs import pg_tmpdir

WORKLOAD_SQL = [
    "CREATE EXTENSION bloom",
    # created empty, then filled: delta inserts, new pages (full images) as it grows
    "CREATE TABLE b (i1 int, i2 int, i3 int, t text)",
    "CREATE INDEX b_bloom ON b USING bloom (i1, i2, i3) WITH (length = 80, col1 = 2, col2 = 2, col3 = 4)",
    "INSERT INTO b SELECT g, g * 2, g % 7, md5(g::text) FROM generate_series(1, 3000) g",
    # built over a loaded table: full images
    "CREATE INDEX b_bloom2 ON b USING bloom (i1, i3)",
    "DELETE FROM b WHERE i1 % 3 = 0",
    "VACUUM b",
    # the pages VACUUM put on the metapage's not-full list take new tuples
    "INSERT INTO b SELECT g, g, g, 'x' FROM generate_series(1, 1000) g",
    "DELETE FROM b",
    "VACUUM b",
    "INSERT INTO b SELECT g, g, g, 'y' FROM generate_series(1, 200) g",
    "CREATE UNLOGGED TABLE bu (i1 int, i2 int)",
    "CREATE INDEX bu_bloom ON bu USING bloom (i1, i2)",
    "INSERT INTO bu SELECT g, g FROM generate_series(1, 200) g",
]


@attrs.frozen
class GenericRun:
    pg: PostgresInstance
    recs: list[DecodedRecord]
    report: VerifyReport


@pytest.fixture(scope="module")
def generic_wal() -> Iterator[GenericRun]:
    with pg_tmpdir("pagestore-redo-generic-") as base:
        pg = PostgresInstance.create(base / "data", settings={**VERIFY_SETTINGS, "shared_buffers": "64MB"})
        try:
            pg.start()
            pg.psql("CHECKPOINT")
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            t0 = time.monotonic()
            for sql in WORKLOAD_SQL:
                pg.psql(sql)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            pg.psql("CHECKPOINT")
            print(f"workload took {time.monotonic() - t0:.1f}s, WAL {(end - start) / 2**20:.1f} MiB")
            t0 = time.monotonic()
            recs = list(read_wal(pg.wal_dir(), start, end))
            rels = {b.rel for r in recs if r.xl_rmid == RmgrId.GENERIC for b in r.blocks}
            # an unlogged index's init fork comes as XLOG/FPI (blbuildempty), its main fork unlogged
            rels |= {b.rel for r in recs for b in r.blocks if b.forknum == 3}
            mine = [r for r in recs if r.blocks and all(b.rel in rels for b in r.blocks)]
            report = verify_records(mine)
            print(report.summary())
            print(f"verified {len(mine)} of {len(recs)} records in {time.monotonic() - t0:.1f}s")
            yield GenericRun(pg, mine, report)
        finally:
            pg.destroy()


@pytest.mark.postgres
def test_every_generic_delta_matches_its_verification_image(generic_wal: GenericRun) -> None:
    recs, report = generic_wal.recs, generic_wal.report
    assert not report.failures, "\n".join(report.failures[:20])
    gen = [r for r in recs if r.xl_rmid == RmgrId.GENERIC]
    deltas = sum(1 for r in gen for b in r.blocks if not b.apply_image and b.has_data)
    images = sum(1 for r in gen for b in r.blocks if b.apply_image)
    multi = sum(1 for r in gen if len(r.blocks) > 1)
    print(f"generic records {len(gen)}: delta blocks {deltas}, full-image blocks {images}, multi-block records {multi}")
    assert report.checked["Generic/Generic"] >= deltas > 1000
    assert images > 0 and report.restored["Generic/Generic"] == images
    assert multi > 0
    assert any(b.forknum == 3 for r in recs for b in r.blocks), "the unlogged index logged no init fork"


@pytest.mark.postgres
def test_replayed_bloom_pages_equal_the_index_files(generic_wal: GenericRun) -> None:
    pg, report = generic_wal.pg, generic_wal.report
    rels = relfilenodes_of_am(pg, "bloom")
    assert {"b_bloom", "b_bloom2", "bu_bloom"} <= set(rels.values())
    pages: Pages = {t: p for t, p in report.pages.items() if t.rel in rels and t.fork != 1}
    compared, differ = compare_with_files(pg, pages, generic_mask)
    print(f"compared {compared} bloom index pages with the files; {len(differ)} differ")
    db = next(iter(pages)).db
    for rel, name in rels.items():
        unbuilt = unbuilt_blocks(pg, pages, db, rel)
        assert not unbuilt, f"{name}: (fork, block) {unbuilt[:10]} were never rebuilt"
    assert compared > 10
    assert not differ, differ[:20]


@pytest.mark.postgres
def test_ingested_generic_records_are_readable(generic_wal: GenericRun, tmp_path: Path) -> None:
    pg = generic_wal.pg
    rels = relfilenodes_of_am(pg, "bloom")
    mine = [r for r in generic_wal.recs if all(b.rel in rels for b in r.blocks)]
    errors, pages = ingest_and_read(tmp_path, mine, rels, unsupported=RmgrId.GENERIC)
    # stored before this redo existed, the same values failed, naming the record and its LSN
    assert errors and all("no redo for resource manager Generic (Generic/" in e and "record ending at" in e for e in errors), errors[:3]
    compared, differ = compare_with_files(pg, pages, generic_mask)
    print(f"ingested and read back {compared} bloom index pages; {len(differ)} differ")
    assert compared > 10
    assert not differ, differ[:20]


# --- the delta format ------------------------------------------------------------------------

MATCH_THRESHOLD = 4  # generic_xlog.c: a fragment header's size


def _region_delta(out: list[bytes], cur: bytes, new: bytes, start: int, end: int, valid_start: int, valid_end: int) -> None:
    """computeRegionDelta: fragments covering where ``new`` differs from ``cur`` in
    [start, end); bytes outside cur's valid region [valid_start, valid_end) always go in."""
    begin = -1
    frag_end = -1
    if valid_start > start:
        begin = start
        start = valid_start
    loop_end = min(end, valid_end)
    i = start
    while i < loop_end:
        if cur[i] != new[i]:
            if begin < 0:
                begin = i
            frag_end = -1
            i += 1
            while i < loop_end and cur[i] != new[i]:
                i += 1
            if i >= loop_end:
                break
        frag_end = i
        i += 1
        while i < loop_end and cur[i] == new[i]:
            i += 1
        if begin >= 0 and i - frag_end > MATCH_THRESHOLD:
            out.append(struct.pack("<HH", begin, frag_end - begin) + new[begin:frag_end])
            begin = frag_end = -1
    if loop_end < end:
        if begin < 0:
            begin = loop_end
        frag_end = end
    if begin >= 0:
        if frag_end < 0:
            frag_end = end
        out.append(struct.pack("<HH", begin, frag_end - begin) + new[begin:frag_end])


def encode_delta(cur: bytes, new: bytes) -> bytes:
    """computeDelta: the lower region [0, pd_lower) and the upper [pd_upper, BLCKSZ) of ``new``."""
    cl, cu = struct.unpack_from("<HH", cur, 12)
    nl, nu = struct.unpack_from("<HH", new, 12)
    out: list[bytes] = []
    _region_delta(out, cur, new, 0, nl, 0, cl)
    _region_delta(out, cur, new, nu, bp.BLCKSZ, cu, bp.BLCKSZ)
    return b"".join(out)


def _page(lower: int, upper: int, fill: bytes) -> bytearray:
    page = bytearray(bp.BLCKSZ)
    page[: len(fill)] = fill
    page[24:lower] = bytes(range(256)) * ((lower - 24) // 256) + bytes((lower - 24) % 256)
    struct.pack_into("<HHHH", page, 12, lower, upper, bp.BLCKSZ, 0x2004)
    page[lower:upper] = bytes(upper - lower)
    return page


@st.composite
def page_edits(draw: st.DrawFn) -> tuple[bytes, bytes]:
    lower = draw(st.integers(24, 4000))
    upper = draw(st.integers(lower, bp.BLCKSZ))
    cur = _page(lower, upper, draw(st.binary(min_size=0, max_size=12)))
    cur[upper:] = random.Random(draw(st.integers(0, 2**32))).randbytes(bp.BLCKSZ - upper)
    new = bytearray(cur)
    for _ in range(draw(st.integers(0, 12))):
        off = draw(st.integers(0, bp.BLCKSZ - 1))
        data = draw(st.binary(min_size=1, max_size=64))
        new[off : off + len(data)] = data[: bp.BLCKSZ - off]
    nl = draw(st.integers(24, 6000))
    nu = draw(st.integers(nl, bp.BLCKSZ))
    struct.pack_into("<HH", new, 12, nl, nu)
    return bytes(cur), bytes(new)


@settings(max_examples=300, deadline=None)
@given(page_edits())
def test_generic_delta_round_trip(edit: tuple[bytes, bytes]) -> None:
    cur, new = edit
    delta = encode_delta(cur, new)
    page = bytearray(cur)
    assert apply_delta(page, delta) is None
    want = bytearray(new)
    nl, nu = struct.unpack_from("<HH", new, 12)
    want[nl:nu] = bytes(nu - nl)  # GenericXLogFinish zeroes the new hole on the primary too
    assert page == want


REL = RelFileNode(1663, 5, 16500)
LSN0 = 0x300_0000


def _redo(delta: bytes, page: bytearray, info: int = 0) -> bytearray | None:
    raw = build_record(prev=0, rmid=RmgrId.GENERIC, info=info, blocks=[BlockSpec(REL, 3, data=delta)])
    rec = decode_record(raw, LSN0, (LSN0 + len(raw) + 7) & ~7)
    return PostgresRedoManager().redo_page(RelBlock(1663, 5, 16500, 0, 3), page, rec)


def test_generic_redo_sets_lsn_and_zeroes_the_hole() -> None:
    cur = _page(100, 8000, b"")
    cur[200:300] = b"\xaa" * 100  # garbage in the hole: redo zeroes it as the primary did
    delta = struct.pack("<HH", 8100, 3) + b"xyz"
    page = _redo(delta, bytearray(cur))
    assert page is not None
    assert page[8100:8103] == b"xyz" and page[100:8000] == bytes(7900)
    assert bp.page_get_lsn(page) > 0


@pytest.mark.parametrize(
    ("delta", "info", "why"),
    [
        (b"\x10\x00", 0, "fragment header cut"),
        (struct.pack("<HH", 100, 50) + b"x" * 10, 0, "runs past the"),
        (struct.pack("<HH", 8190, 4) + b"abcd", 0, "runs past the page"),
        (struct.pack("<HH", 12, 4) + struct.pack("<HH", 900, 800), 0, "pd_lower 900 and pd_upper 800"),
        (struct.pack("<HH", 14, 2) + struct.pack("<H", 9000), 0, "pd_upper 9000"),
        (b"", 0x10, "unknown record type"),
    ],
)
def test_hostile_generic_deltas_raise_redo_error(delta: bytes, info: int, why: str) -> None:
    with pytest.raises(RedoError, match=why) as exc:
        _redo(delta, _page(100, 8000, b""), info)
    assert "Generic" in str(exc.value) and "record ending at" in str(exc.value)


@settings(max_examples=300, deadline=None)
@given(delta=st.binary(max_size=200), lower=st.integers(0, 9000), upper=st.integers(0, 9000))
def test_garbage_generic_deltas_give_a_page_or_a_clear_error(delta: bytes, lower: int, upper: int) -> None:
    page = _page(100, 8000, b"")
    struct.pack_into("<HH", page, 12, lower & 0xFFFF, upper & 0xFFFF)
    try:
        out = _redo(delta, page)
    except RedoError as exc:
        assert "Generic" in str(exc)
        return
    assert out is not None and len(out) == bp.BLCKSZ
