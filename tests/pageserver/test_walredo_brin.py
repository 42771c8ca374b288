"""BRIN redo on real WAL from the installed PostgreSQL 15 (``wal_consistency_checking = all``).

Three BRIN indexes are created on an empty table (one heap row per page, fillfactor 10) and
then filled: ``br_id`` (minmax, one heap page per range, so the revmap outgrows its first page
and takes over a block that held summaries: evacuation by UPDATE, then REVMAP_EXTEND),
``br_multi`` (minmax-multi and text minmax: summaries that grow and move to another page,
UPDATE and UPDATE+INIT) and ``br_bloom``. Ranges are summarized with
``brin_summarize_new_values`` (placeholder INSERT then SAMEPAGE_UPDATE), widened by later
inserts and updates, desummarized with ``brin_desummarize_range`` (DESUMMARIZE), summarized
again by VACUUM and ``brin_summarize_range``.

Checks: every BRIN block reference with a verification image equals the replayed page masked
with ``brin_mask``; every page of the three indexes, rebuilt from nothing the way GetPage
does, and read back through WAL ingest, equals the data file after CHECKPOINT; every record
type occurred and was applied; a broken revmap update is caught; cut-short records raise
``RedoError``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import attrs
import pytest

from pageserver.walredo import brin
from pageserver.walredo.brin import brin_mask
from pageserver.walredo.errors import RedoError
from pageserver.walredo.verify import VerifyReport, verify_records
from protocol.wal.rmgr import RmgrId
from tests.pageserver.gin_brin_capture import (
    Capture,
    brin_kinds,
    capture,
    compare_with_file,
    ingest_then_read,
    rebuild_pages,
    replay_variants,
)

pytestmark = pytest.mark.postgres

BRIN_SQL = [
    "CREATE TABLE br (id int, v int, t text, pad text DEFAULT repeat('x', 400)) WITH (fillfactor = 10)",
    "CREATE INDEX br_id ON br USING brin (id) WITH (pages_per_range = 1)",
    "CREATE INDEX br_multi ON br USING brin (v int4_minmax_multi_ops, t) WITH (pages_per_range = 4)",
    "CREATE INDEX br_bloom ON br USING brin (v int4_bloom_ops) WITH (pages_per_range = 8)",
    "INSERT INTO br (id, v, t) SELECT g, g % 97, md5(g::text) FROM generate_series(1, 1500) g",
    "SELECT brin_summarize_new_values('br_id')",
    "SELECT brin_summarize_new_values('br_multi')",
    "SELECT brin_summarize_new_values('br_bloom')",
    # rows into summarized ranges: summaries widen in place or move to another page
    "INSERT INTO br (id, v, t) SELECT g, g * 7919 % 100003, repeat(md5(g::text), 3) FROM generate_series(1, 400) g",
    "UPDATE br SET t = repeat(md5(id::text), 6) WHERE id % 50 = 0",
    "SELECT brin_desummarize_range('br_id', 10)",
    "SELECT brin_desummarize_range('br_id', 11)",
    "SELECT brin_desummarize_range('br_multi', 8)",
    "DELETE FROM br WHERE id % 3 = 0",
    "VACUUM br",
    "SELECT brin_summarize_range('br_id', 10)",
]
INDEXES = ["br_id", "br_multi", "br_bloom"]
TYPES = [
    "CREATE_INDEX", "INSERT", "INSERT+INIT", "UPDATE", "UPDATE+INIT", "SAMEPAGE_UPDATE",
    "REVMAP_EXTEND", "DESUMMARIZE",
]


@attrs.define
class Run:
    cap: Capture
    report: VerifyReport
    seconds: float


@pytest.fixture(scope="module")
def run() -> Run:
    cap = capture(BRIN_SQL, INDEXES)
    t0 = time.monotonic()
    report = verify_records(cap.records)
    return Run(cap, report, time.monotonic() - t0)


def test_every_brin_record_matches_its_verification_image(run: Run) -> None:
    report = run.report
    print(report.summary())
    print(f"workload {run.cap.seconds:.1f}s, {len(run.cap.records)} records verified in {run.seconds:.1f}s")
    assert not report.failures, "\n".join(report.failures[:20])
    kinds = brin_kinds(run.cap.records)
    print(dict(kinds))
    missing = [k for k in [*TYPES, "REVMAP_EXTEND over a regular page"] if not kinds[k]]
    assert not missing, f"the workload wrote no {missing}"
    unchecked = [t for t in TYPES if not report.checked[f"BRIN/{t}"]]
    assert not unchecked, f"no verification image was compared for {unchecked}"


def test_index_pages_rebuilt_from_nothing_equal_the_data_files(run: Run) -> None:
    total = 0
    applied: dict[str, int] = {}
    for name in INDEXES:
        node, data = run.cap.files[name]
        pages, stats, errors = rebuild_pages(run.cap.records, node)
        assert not errors, errors[:10]
        nblocks, problems = compare_with_file(pages, data, brin_mask)
        print(f"{name}: {nblocks} pages, {len(problems)} differ")
        assert not problems, f"{name}: {problems[:10]}"
        total += nblocks
        for k, v in stats.applied.items():
            applied[k] = applied.get(k, 0) + v
    print(applied)
    assert total >= 20
    assert all(applied.get(f"BRIN/{t}", 0) > 0 for t in TYPES), applied


def test_ingested_records_read_back(run: Run, tmp_path: Path) -> None:
    """Through WalIngest: without BRIN redo the stored records fail naming record and LSN;
    the same stored values read back equal to the data files once BRIN redo is there."""
    nodes = {run.cap.files[name][0]: name for name in INDEXES}
    errors, pages = ingest_then_read(tmp_path, run.cap.records, nodes, RmgrId.BRIN)
    assert errors and all(re.search(r"no redo for resource manager BRIN \(BRIN/[\w+]+\).*record ending at", e) for e in errors), errors[:3]
    for node, name in nodes.items():
        nblocks, problems = compare_with_file(pages[node], run.cap.files[name][1], brin_mask)
        assert nblocks == len(pages[node]) and not problems, f"{name}: {problems[:10]}"


def test_a_wrong_revmap_update_is_caught(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: revmap entries that point one line pointer too far."""
    real = brin._set_revmap_entry

    def broken(page: bytearray, ppr: int, heap_blk: int, blkno: int, offnum: int, rec: object) -> None:
        real(page, ppr, heap_blk, blkno, offnum + 1, rec)  # type: ignore[arg-type]

    monkeypatch.setattr(brin, "_set_revmap_entry", broken)
    report = verify_records(run.cap.records, max_failures=5)
    assert report.failures and all("BRIN/" in f for f in report.failures), report.failures


def test_truncated_records_raise_redo_errors(run: Run) -> None:
    """Real BRIN records cut short or garbled. Main data cut: RedoError naming the record
    and its LSN. Block data cut: a BRIN tuple carries no length of its own (PostgreSQL takes
    the block data's), so a shorter tuple may be stored, as a garbled one may; anything else
    is a RedoError, never another exception."""
    results = replay_variants(run.cap.records, RmgrId.BRIN)
    kinds = {rec.record_type for rec, _w, _e in results}
    print(f"{len(results)} truncated replays of {sorted(kinds)}")
    assert set(TYPES) <= kinds
    for rec, what, exc in results:
        if what.startswith("main data cut"):
            assert isinstance(exc, RedoError), f"{rec.record_type} with {what}: {exc!r}"
        else:
            assert exc is None or isinstance(exc, RedoError), f"{rec.record_type} with {what}: {exc!r}"
        if exc is not None:
            assert f"BRIN/{rec.record_type}" in str(exc) and "record ending at" in str(exc), exc
