"""GIN redo on real WAL from the installed PostgreSQL 15 (``wal_consistency_checking = all``).

The indexes are created empty and then filled, so their pages arrive as incremental GIN
records, not as the full-page images of an index build:

- ``gl_k`` (text[] of ~800-byte keys, fastupdate off): entry-leaf inserts, leaf and internal
  splits (the internal ones clear the child's incomplete-split flag), root splits;
- ``gj_doc`` (jsonb, fastupdate on, 64 kB pending list): pending-list appends, new sublists,
  automatic and explicit (``gin_clean_pending_list``) flushes that delete list pages and
  insert/replace entry tuples;
- ``gp_a`` (int[] with one key in 20,000 rows): a pending list flushed into a posting tree
  (CREATE_PTREE, leaf inserts, root and non-root leaf splits, internal inserts), then with
  fastupdate off per-row ADDITEMS, inserts into freed heap space (into old segments), VACUUM
  (segment REPLACE/DELETE, empty leaves deleted: DELETE_PAGE), and emptied.

Statements that only load or delete heap rows of ``gp`` run with checking off in their
session (20,000 heap images cost seconds of replay and test nothing of GIN; the GIN records
they write, pending-list appends, are checked in the ``gj`` phase). Their records are still
replayed, and the final pages are compared with the data files.

Checks: every GIN block reference with a verification image equals the replayed page masked
with ``gin_mask``; every page of the three indexes, rebuilt from nothing the way GetPage does,
equals the data file after CHECKPOINT; every record type and sub-kind occurred and was applied.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import attrs
import pytest

from pageserver.walredo import bufpage as bp
from pageserver.walredo import gin_posting
from pageserver.walredo.errors import RedoError
from pageserver.walredo.gin import gin_mask
from pageserver.walredo.manager import PostgresRedoManager, RelBlock
from pageserver.walredo.verify import VerifyReport, verify_records
from protocol.wal.record import BKPBLOCK_HAS_IMAGE
from protocol.wal.rmgr import RmgrId
from tests.pageserver.gin_brin_capture import (
    Capture,
    capture,
    compare_with_file,
    gin_kinds,
    ingest_then_read,
    rebuild_pages,
    replay_variants,
)

pytestmark = pytest.mark.postgres

UNCHECKED = "SET wal_consistency_checking = ''; "
GIN_SQL = [
    # entry tree of long keys: leaf and internal splits
    "CREATE TABLE gl (k text[])",
    "CREATE INDEX gl_k ON gl USING gin (k) WITH (fastupdate = off)",
    "INSERT INTO gl SELECT ARRAY[(SELECT string_agg(md5(g::text || i::text), '') FROM generate_series(1, 25) i)] FROM generate_series(1, 500) g",
    # fast update: pending list, flushes
    "CREATE TABLE gj (id int, doc jsonb)",
    "CREATE INDEX gj_doc ON gj USING gin (doc) WITH (fastupdate = on, gin_pending_list_limit = 64)",
    "INSERT INTO gj SELECT g, jsonb_build_object('k', g % 10, 'g', g) FROM generate_series(1, 2000) g",
    "SELECT gin_clean_pending_list('gj_doc')",
    "INSERT INTO gj SELECT g, jsonb_build_object('k', g % 10) FROM generate_series(1, 300) g",
    # a posting tree from one flush of 20,000 TIDs
    "CREATE TABLE gp (id int, a int[])",
    "CREATE INDEX gp_a ON gp USING gin (a) WITH (fastupdate = on, gin_pending_list_limit = 16384)",
    UNCHECKED + "INSERT INTO gp SELECT g, ARRAY[1] FROM generate_series(1, 20000) g",
    "SELECT gin_clean_pending_list('gp_a')",
    "ALTER INDEX gp_a SET (fastupdate = off)",
    "INSERT INTO gp SELECT g, ARRAY[1] FROM generate_series(20001, 20200) g",
    # vacuum: shrink segments, delete the middle leaves, shrink entry tuples
    UNCHECKED + "DELETE FROM gp WHERE id % 2 = 0 AND id < 3000",
    UNCHECKED + "DELETE FROM gp WHERE id BETWEEN 7000 AND 15000",
    "DELETE FROM gl WHERE length(k[1]) % 3 = 0 OR k[1] < '4'",
    "DELETE FROM gj WHERE id % 3 = 0",
    "VACUUM gp",
    "VACUUM gl",
    "VACUUM gj",
    # new rows in freed heap space: TIDs inside old segments
    "INSERT INTO gp SELECT g, ARRAY[1] FROM generate_series(30001, 30400) g",
    # emptied
    "DELETE FROM gl",
    "VACUUM gl",
    UNCHECKED + "DELETE FROM gp WHERE id > 1000",
    "VACUUM gp",
]
INDEXES = ["gl_k", "gj_doc", "gp_a"]

# record sub-kinds the workload must produce (gin_kinds)
KINDS = [
    "INSERT entry leaf", "INSERT entry leaf replace", "INSERT entry internal",
    "INSERT data leaf", "INSERT data internal", "INSERT child split finished",
    "SPLIT entry leaf", "SPLIT entry leaf root", "SPLIT entry internal", "SPLIT data leaf",
    "SPLIT data leaf root",
    "UPDATE_META_PAGE tail insert", "UPDATE_META_PAGE new sublist", "UPDATE_META_PAGE meta only",
    "leaf action ADDITEMS", "leaf action INSERT", "leaf action REPLACE",
    "vacuum action DELETE", "vacuum action REPLACE",
]
# validated against a verification image (the rest come as forced images: SPLIT, VACUUM_PAGE)
CHECKED = [
    "Gin/CREATE_PTREE", "Gin/INSERT", "Gin/UPDATE_META_PAGE", "Gin/INSERT_LISTPAGE",
    "Gin/DELETE_LISTPAGE", "Gin/VACUUM_DATA_LEAF_PAGE", "Gin/DELETE_PAGE", "Gin/SPLIT",
]
TYPES = [*CHECKED, "Gin/VACUUM_PAGE"]


@attrs.define
class Run:
    cap: Capture
    report: VerifyReport
    seconds: float


@pytest.fixture(scope="module")
def run() -> Run:
    cap = capture(GIN_SQL, INDEXES)
    t0 = time.monotonic()
    report = verify_records(cap.records)
    return Run(cap, report, time.monotonic() - t0)


def test_every_gin_record_matches_its_verification_image(run: Run) -> None:
    report = run.report
    print(report.summary())
    print(f"workload {run.cap.seconds:.1f}s, {len(run.cap.records)} records verified in {run.seconds:.1f}s")
    assert not report.failures, "\n".join(report.failures[:20])
    kinds = gin_kinds(run.cap.records)
    print("\n".join(f"  {k:32s} {v:7d}" for k, v in sorted(kinds.items())))
    missing = [k for k in KINDS if not kinds[k]]
    assert not missing, f"the workload wrote no {missing}"
    unchecked = [t for t in CHECKED if not report.checked[t]]
    assert not unchecked, f"no verification image was compared for {unchecked}"
    # forced images: SPLIT pages and entry-leaf vacuums are restored, then checked downstream
    assert report.restored["Gin/SPLIT"] and report.restored["Gin/VACUUM_PAGE"]


def test_index_pages_rebuilt_from_nothing_equal_the_data_files(run: Run) -> None:
    """GetPage's way: per block, the stored raw records only, by a fresh manager."""
    total = 0
    applied: dict[str, int] = {}
    for name in INDEXES:
        node, data = run.cap.files[name]
        pages, stats, errors = rebuild_pages(run.cap.records, node)
        assert not errors, errors[:10]
        nblocks, problems = compare_with_file(pages, data, gin_mask)
        print(f"{name}: {nblocks} pages, {len(problems)} differ")
        assert not problems, f"{name}: {problems[:10]}"
        total += nblocks
        for k, v in stats.applied.items():
            applied[k] = applied.get(k, 0) + v
    print(applied)
    assert total > 150
    assert all(applied.get(t, 0) > 0 for t in TYPES), applied


def test_ingested_records_read_back(run: Run, tmp_path: Path) -> None:
    """The index WAL through WalIngest (raw records under every block they reference, blocks
    without data included): stored without GIN redo, reads fail naming the record and its
    LSN; the same stored values read back equal to the data files once GIN redo is there."""
    nodes = {run.cap.files[name][0]: name for name in INDEXES}
    errors, pages = ingest_then_read(tmp_path, run.cap.records, nodes, RmgrId.GIN)
    assert errors and all(re.search(r"no redo for resource manager Gin \(Gin/\w+\).*record ending at", e) for e in errors), errors[:3]
    for node, name in nodes.items():
        nblocks, problems = compare_with_file(pages[node], run.cap.files[name][1], gin_mask)
        assert nblocks == len(pages[node]) and not problems, f"{name}: {problems[:10]}"


def test_a_wrong_posting_list_encoding_is_caught(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: an encoder that drops the last item of every re-encoded segment."""
    real = gin_posting.encode_segment

    def broken(items: list[int], maxsize: int = 8192) -> tuple[bytes, int]:
        seg, n = real(items[:-1] if len(items) > 1 else items, maxsize)
        return seg, len(items) if n == len(items) - 1 else n

    monkeypatch.setattr(gin_posting, "encode_segment", broken)
    node = run.cap.files["gp_a"][0]
    posting_tree = [r for r in run.cap.records if any(b.rel == node for b in r.blocks)]
    report = verify_records(posting_tree, max_failures=5)
    assert report.failures and all("Gin/INSERT" in f for f in report.failures), report.failures


def test_truncated_records_raise_redo_errors(run: Run) -> None:
    """Real GIN records cut short (main data, block data): every replay raises RedoError
    naming the record and its LSN, never IndexError or a page. Garbled bytes: RedoError or a
    page, never another exception."""
    results = replay_variants(run.cap.records, RmgrId.GIN)
    kinds = {rec.record_type for rec, _w, _e in results}
    print(f"{len(results)} truncated replays of {sorted(kinds)}")
    assert {"INSERT", "UPDATE_META_PAGE", "INSERT_LISTPAGE", "DELETE_LISTPAGE", "CREATE_PTREE",
            "VACUUM_DATA_LEAF_PAGE", "DELETE_PAGE", "SPLIT"} <= kinds
    for rec, what, exc in results:
        if "garbled" in what:  # a changed byte inside a tuple or a TID cannot be told apart
            assert exc is None or isinstance(exc, RedoError), f"{rec.record_type} with {what}: {exc!r}"
        else:
            assert isinstance(exc, RedoError), f"{rec.record_type} with {what}: {exc!r}"
        if exc is not None:
            assert f"Gin/{rec.record_type}" in str(exc) and "record ending at" in str(exc), exc


def test_a_split_without_its_images_is_an_error(run: Run) -> None:
    """SPLIT and VACUUM_PAGE pages come only as forced images; a record that lost them is
    not replayed from anything else."""
    mgr = PostgresRedoManager()
    done = set()
    for rec in run.cap.records:
        if rec.xl_rmid != RmgrId.GIN or rec.record_type not in ("SPLIT", "VACUUM_PAGE") or rec.record_type in done:
            continue
        done.add(rec.record_type)
        b0 = rec.blocks[0]
        stripped = attrs.evolve(b0, fork_flags=b0.fork_flags & ~BKPBLOCK_HAS_IMAGE, image_data=None, bimg_info=0)
        bad = attrs.evolve(rec, blocks=(stripped, *rec.blocks[1:]))
        t = RelBlock(b0.spc, b0.db, b0.rel, b0.forknum, b0.blkno)
        with pytest.raises(RedoError, match=rf"Gin/{rec.record_type}: .*full-page image.*record ending at"):
            mgr.redo_page(t, bytearray(bp.new_page(8)), bad)
    assert done == {"SPLIT", "VACUUM_PAGE"}
