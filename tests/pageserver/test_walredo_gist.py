"""GiST redo (rmid 14) against real WAL from the installed PostgreSQL 15.

Indexes created empty, then filled, updated, vacuumed and emptied, so every page change
arrives as an incremental GiST record: points, boxes and int4ranges (leaf splits, a root split,
one-for-one replacements, VACUUM deletions and page deletion), points whose dead tuples an
index scan marks LP_DEAD before inserts prune them (Gist/DELETE), an emptied index whose
deleted pages are reused (Gist/PAGE_REUSE), and tsvector keys with 1500-byte signatures so
internal pages split too (PAGE_SPLIT with the left child to fix, internal root splits into
three pages). With wal_consistency_checking = all every block reference carries PostgreSQL's
page, which each replayed page must equal after gist_mask; pages rebuilt from the records
alone must equal the data files after CHECKPOINT; the WAL through ingest reads back.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compute.postgres import PostgresInstance
from pageserver.pgdatadir import Datadir, RelTag
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.walredo import bufpage as bp
from pageserver.walredo import gist
from pageserver.walredo import manager as redo_manager
from pageserver.walredo.errors import RedoError
from pageserver.walredo.manager import PostgresRedoManager, RelBlock
from pageserver.walredo.mask import gist_mask, masked
from pageserver.walredo.verify import verify_records
from protocol.lsn import Lsn
from protocol.wal.record import BKPIMAGE_APPLY, DecodedRecord
from protocol.wal.rmgr import RmgrId
from tests.pageserver.walredo_capture import (
    Capture,
    capture,
    compare_with_files,
    ingest_and_read,
    per_block,
    records_touching,
    rels_of,
)

pytestmark = pytest.mark.postgres


def _kill_dead_tuples(pg: PostgresInstance) -> None:
    # plain index scans over deleted rows mark their tuples LP_DEAD and the pages HAS_GARBAGE
    for _ in range(2):
        pg.psql(
            "SET enable_seqscan = off; SET enable_bitmapscan = off;"
            " SELECT count(*) FROM gp WHERE p <@ box '((0,0),(1000,1000))'"
        )


SQL: list[str | object] = [
    "CREATE TABLE gp (id int, p point)",
    "CREATE INDEX gp_p ON gp USING gist (p)",
    "INSERT INTO gp SELECT g, point(g % 211, g % 197) FROM generate_series(1, 5000) g",
    "CREATE TABLE gb (id int, b box)",
    "CREATE INDEX gb_b ON gb USING gist (b)",
    "INSERT INTO gb SELECT g, box(point(g % 100, g % 37), point(g % 100 + 5, g % 37 + 3))"
    " FROM generate_series(1, 2500) g",
    "CREATE TABLE gr (id int, r int4range)",
    "CREATE INDEX gr_r ON gr USING gist (r)",
    "INSERT INTO gr SELECT g, int4range(g % 500, g % 500 + g % 17 + 1) FROM generate_series(1, 2500) g",
    # big internal keys: internal pages split, the root splits as an internal page
    "CREATE TABLE doc (id int, tsv tsvector)",
    "CREATE INDEX doc_tsv ON doc USING gist (tsv tsvector_ops (siglen = 1500))",
    "INSERT INTO doc SELECT g, (SELECT to_tsvector('simple', string_agg(substr(md5((g * 40 + k)::text), 1, 5), ' '))"
    " FROM generate_series(1, 25) k) FROM generate_series(1, 1000) g",
    # insert-time removal of LP_DEAD tuples: Gist/DELETE
    "DELETE FROM gp WHERE id % 4 <> 0",
    _kill_dead_tuples,
    "INSERT INTO gp SELECT g, point(g % 211, g % 197) FROM generate_series(1, 2500) g",
    # VACUUM: PAGE_UPDATE deletions, PAGE_DELETE of emptied leaves
    "DELETE FROM gb WHERE id % 3 = 0",
    "DELETE FROM gr WHERE id < 1700",
    "DELETE FROM doc WHERE id % 2 = 0",
    "VACUUM gb",
    "VACUUM gr",
    "VACUUM doc",
    "UPDATE gb SET b = box(point(0, 0), point(1, 1)) WHERE id % 7 = 1",
    # emptied: every leaf deleted; the second VACUUM makes them reusable (PAGE_REUSE)
    "DELETE FROM gp",
    "DELETE FROM doc",
    "VACUUM gp",
    "VACUUM doc",
    "VACUUM gp",
    "INSERT INTO gp SELECT g, point(g % 50, g % 40) FROM generate_series(1, 2500) g",
]

PAGE_RECORD_TYPES = ["PAGE_UPDATE", "DELETE", "PAGE_SPLIT", "PAGE_DELETE"]


@pytest.fixture(scope="module")
def cap() -> Capture:
    c = capture(SQL)  # type: ignore[arg-type]
    print(f"workload {c.seconds:.1f}s, {len(c.records)} records, WAL {(c.end - c.start) / 2**20:.0f} MiB")
    return c


def _gist_rels(c: Capture) -> set[int]:
    rels = rels_of(c, "gist")
    assert len(rels) == 4
    return rels


def _cases(records: list[DecodedRecord]) -> Counter[str]:
    c: Counter[str] = Counter()
    for r in records:
        if r.xl_rmid != RmgrId.GIST:
            continue
        t = r.record_type
        c[t] += 1
        if t == "PAGE_UPDATE":
            nd, ni = struct.unpack_from("<HH", r.main_data)
            c["PAGE_UPDATE one-for-one replacement"] += nd == 1 and ni == 1
            c["PAGE_UPDATE deletions only (VACUUM)"] += nd > 0 and ni == 0
            c["PAGE_UPDATE downlink of a split child (b1)"] += r.block(1) is not None
        elif t == "PAGE_SPLIT":
            _rl, _nsn, leaf, npage, _mfr = struct.unpack_from("<I4xQBxHB", r.main_data)
            b1 = r.block(1)
            assert b1 is not None
            c["PAGE_SPLIT root"] += b1.blkno == 0
            c["PAGE_SPLIT internal page"] += not leaf
            c["PAGE_SPLIT with a left child to fix (b0)"] += r.block(0) is not None
            c["PAGE_SPLIT into three or more pages"] += npage > 2
        elif t == "DELETE":
            c["DELETE with offsets"] += len(r.main_data) > 6
    return c


def test_every_gist_record_matches_its_verification_image(cap: Capture) -> None:
    report = verify_records(records_touching(cap, _gist_rels(cap)))
    print(report.summary())
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.adopted == 0
    for t in PAGE_RECORD_TYPES:
        assert report.checked[f"Gist/{t}"] > 0, f"no Gist/{t} was replayed and checked"
    cases = _cases(cap.records)
    print("\n".join(f"{n:7d} {k}" for k, n in sorted(cases.items())))
    missing = [k for k in (
        "PAGE_REUSE", "PAGE_UPDATE one-for-one replacement", "PAGE_UPDATE deletions only (VACUUM)",
        "PAGE_UPDATE downlink of a split child (b1)", "PAGE_SPLIT root", "PAGE_SPLIT internal page",
        "PAGE_SPLIT with a left child to fix (b0)", "PAGE_SPLIT into three or more pages", "DELETE with offsets",
    ) if not cases[k]]
    assert not missing, f"the workload did not produce {missing}"


def test_tuples_deleted_flag_follows_the_primary(cap: Capture) -> None:
    """Unmasked F_TUPLES_DELETED: the flag redo leaves equals the primary's on every image
    (installed 15.18: VACUUM sets it, insert-time pruning does not)."""
    rels = _gist_rels(cap)
    pages: dict[RelBlock, bytearray] = {}
    mgr = PostgresRedoManager()
    checked = 0
    for r in records_touching(cap, rels):
        for b in r.blocks:
            t = RelBlock(b.spc, b.db, b.rel, b.forknum, b.blkno)
            new = mgr.redo_page(t, pages.get(t), r)
            assert new is not None
            pages[t] = new
            img = b.image if b.has_image and not b.apply_image else None
            if img is not None and r.xl_rmid == RmgrId.GIST:
                assert gist.get_flags(new) & gist.F_TUPLES_DELETED == gist.get_flags(img) & gist.F_TUPLES_DELETED
                checked += 1
    assert checked > 1000


def test_pages_rebuilt_from_records_equal_data_files(cap: Capture) -> None:
    rels = _gist_rels(cap)
    mgr = PostgresRedoManager(count=True)
    rebuilt = {t: mgr.apply_to_target(t, None, recs) for t, recs in per_block(cap, rels).items()}
    compared = compare_with_files(cap, rebuilt, rels, gist_mask)
    print(f"compared {compared} GiST pages with the data files; applied {dict(mgr.stats.applied)}")
    assert compared > 50
    for t in PAGE_RECORD_TYPES:
        assert mgr.stats.applied[f"Gist/{t}"] > 0


def test_ingested_records_are_readable(cap: Capture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rels = _gist_rels(cap)
    targets = sorted((t for t in cap.pages if t.rel in rels), key=lambda t: (t.rel, t.blkno))

    async def unreadable_without_redo(dd: Datadir, lsn: Lsn) -> None:
        t = targets[0]
        with monkeypatch.context() as m:
            m.delitem(redo_manager.REDO_ROUTINES, RmgrId.GIST)
            with pytest.raises(PageReconstructError, match=r"no redo for resource manager Gist \(Gist/\w+\).*record ending at"):
                await dd.get_page(RelTag(t.spc, t.db, t.rel, 0), t.blkno, lsn)

    got = ingest_and_read(cap, tmp_path, targets, unreadable_without_redo, rels)
    rebuilt = {t: p for t, p in got.items() if p != bytes(bp.BLCKSZ) or cap.pages[t] != p}
    assert compare_with_files(cap, rebuilt, rels, gist_mask) > 50


def test_left_child_fix_applies_on_top_of_a_restored_image(cap: Capture) -> None:
    """A left child logged with an applied image still gets its NSN and loses F_FOLLOW_RIGHT
    (the image predates them). The verification image is the child as logged; marked APPLY,
    replay must give what incremental replay gives."""
    rels = _gist_rels(cap)
    pages: dict[RelBlock, bytearray] = {}
    mgr = PostgresRedoManager()
    done = Counter[str]()
    for r in records_touching(cap, rels):
        for b in r.blocks:
            t = RelBlock(b.spc, b.db, b.rel, b.forknum, b.blkno)
            new = mgr.redo_page(t, pages.get(t), r)
            assert new is not None
            left_child = r.xl_rmid == RmgrId.GIST and (
                (r.record_type == "PAGE_UPDATE" and b.block_id == 1) or (r.record_type == "PAGE_SPLIT" and b.block_id == 0)
            )
            if left_child and b.has_image and not b.apply_image:
                assert b.image is not None
                assert gist.get_flags(b.image) & gist.F_FOLLOW_RIGHT  # as logged, before the fix
                forged_blk = attrs.evolve(b, bimg_info=b.bimg_info | BKPIMAGE_APPLY)
                forged = attrs.evolve(r, blocks=tuple(forged_blk if x is b else x for x in r.blocks))
                got = mgr.redo_page(t, None, forged)
                assert got is not None
                assert not gist.get_flags(got) & gist.F_FOLLOW_RIGHT
                assert bp.LSN_HALVES.unpack_from(got, bp.BLCKSZ - 16) == (r.end_lsn >> 32, r.end_lsn & 0xFFFF_FFFF)
                assert masked(got, t.blkno, gist_mask) == masked(new, t.blkno, gist_mask)
                assert got[bp.BLCKSZ - 16 :] == new[bp.BLCKSZ - 16 :]
                done[r.record_type] += 1
            pages[t] = new
    assert done["PAGE_UPDATE"] and done["PAGE_SPLIT"], done


# --- hostile input ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples(cap: Capture) -> list[tuple[DecodedRecord, RelBlock, bytearray]]:
    """One replayable (record, block, page before it) per record type and block id."""
    pages: dict[RelBlock, bytearray] = {}
    seen: set[tuple[str, int]] = set()
    out: list[tuple[DecodedRecord, RelBlock, bytearray]] = []
    mgr = PostgresRedoManager()
    for r in records_touching(cap, _gist_rels(cap)):
        for b in r.blocks:
            t = RelBlock(b.spc, b.db, b.rel, b.forknum, b.blkno)
            before = pages.get(t)
            if r.xl_rmid == RmgrId.GIST and not b.apply_image and (before is not None or b.will_init):
                key = (r.record_type, b.block_id if b.block_id < 3 else 3)
                if key not in seen:
                    seen.add(key)
                    out.append((r, t, bytearray(before) if before is not None else bytearray(bp.BLCKSZ)))
            new = mgr.redo_page(t, before, r)
            assert new is not None
            pages[t] = new
    assert {r.record_type for r, _, _ in out} == set(PAGE_RECORD_TYPES)
    return out


def _replay(rec: DecodedRecord, t: RelBlock, page: bytearray) -> bytearray | None:
    base = bytearray(page)
    bp.page_set_lsn(base, 0)
    return PostgresRedoManager().redo_page(t, base, rec)


def _with_block_data(rec: DecodedRecord, t: RelBlock, data: bytes) -> DecodedRecord:
    blocks = tuple(attrs.evolve(b, data=data) if (b.rel, b.blkno) == (t.rel, t.blkno) else b for b in rec.blocks)
    return attrs.evolve(rec, blocks=blocks)


def test_truncated_record_data_is_an_error(samples: list[tuple[DecodedRecord, RelBlock, bytearray]]) -> None:
    """Cut main data (every record type) and block data (PAGE_UPDATE, PAGE_SPLIT): RedoError."""
    for rec, t, page in samples:
        assert _replay(rec, t, page) is not None
        for cut in range(len(rec.main_data)):
            if rec.record_type == "DELETE" and cut == 6:
                continue  # the fixed part alone is valid: "nothing to delete, clear HAS_GARBAGE"
            with pytest.raises(RedoError, match="Gist"):
                _replay(attrs.evolve(rec, main_data=rec.main_data[:cut]), t, page)
        blk = next(b for b in rec.blocks if (b.rel, b.blkno) == (t.rel, t.blkno))
        data = blk.data
        if not data:
            continue
        step = max(1, len(data) // 50)
        for cut in sorted(set(range(min(len(data), 16))) | set(range(16, len(data), step))):
            with pytest.raises(RedoError, match="Gist"):
                _replay(_with_block_data(rec, t, data[:cut]), t, page)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbled_record_data_fails_cleanly(samples: list[tuple[DecodedRecord, RelBlock, bytearray]], data: st.DataObject) -> None:
    """Flipped bytes in the main or block data: a RedoError or a page, never another exception."""
    rec, t, page = data.draw(st.sampled_from(samples))
    blk = next(b for b in rec.blocks if (b.rel, b.blkno) == (t.rel, t.blkno))
    in_block = bool(blk.data) and data.draw(st.booleans())
    buf = bytearray(blk.data if in_block else rec.main_data)
    for _ in range(data.draw(st.integers(1, 4))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    bad = _with_block_data(rec, t, bytes(buf)) if in_block else attrs.evolve(rec, main_data=bytes(buf))
    try:
        _replay(bad, t, page)
    except RedoError:
        pass


def test_a_wrong_redo_is_caught(cap: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a split that forgets the right link is reported."""
    real = gist._page_split

    def no_rightlink(page: bytearray, rec: DecodedRecord, blk: object) -> None:
        real(page, rec, blk)  # type: ignore[arg-type]
        struct.pack_into("<I", page, bp.BLCKSZ - 8, gist.INVALID_BLOCK)

    monkeypatch.setitem(gist._ROUTINES, 0x30, no_rightlink)
    report = verify_records(records_touching(cap, _gist_rels(cap)), max_failures=5)
    assert report.failures and all("Gist/PAGE_SPLIT" in f for f in report.failures), report.failures
