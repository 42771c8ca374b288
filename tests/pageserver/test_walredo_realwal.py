"""THE redo test: every page PostgreSQL 15 logged for verification equals our replay.

A real PostgreSQL runs with ``wal_consistency_checking = 'all'``, so each block reference of
each record carries the page as it was right after the change. The workloads cover pgbench,
btree splits and new roots, deletes + VACUUM (incl. page deletion), HOT and non-HOT updates,
multixacts (FOR SHARE from two sessions), sequences, TOAST, CREATE INDEX, TRUNCATE and
subtransactions with rollbacks. The WAL is then read with protocol.wal's reader and replayed
page by page; any difference (masked as PostgreSQL masks) fails the test. CLOG pages rebuilt
from the commit/abort records must equal ``pg_xact`` after a CHECKPOINT.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from compute.postgres import PostgresInstance
from pageserver.walredo import bufpage as bp
from pageserver.walredo import clog
from pageserver.walredo.manager import PostgresRedoManager, SlruPage
from pageserver.walredo.verify import VERIFY_SETTINGS, VerifyReport, read_wal, verify_records
from protocol.lsn import parse_lsn
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import XLOG_MULTIXACT_CREATE_ID, RmgrId
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres

SETTINGS = {**VERIFY_SETTINGS, "shared_buffers": "64MB"}

WORKLOAD_SQL = [
    # btree: rightmost splits up to a level-2 root, and random (middle) splits
    "CREATE TABLE big (id int PRIMARY KEY, v text, pad int DEFAULT 0)",
    "INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 4000) g",
    "CREATE INDEX big_v ON big (v)",  # CREATE INDEX: pages come as XLOG/FPI
    # wide keys (~10 per page) reach a level-2 root after a few hundred rows
    "CREATE TABLE wide (k text)",
    "CREATE INDEX wide_k ON wide (k)",
    "INSERT INTO wide SELECT lpad(g::text, 700, 'x') FROM generate_series(1, 300) g",
    "INSERT INTO wide SELECT lpad(md5(random()::text), 700, 'r') FROM generate_series(1, 200)",
    "CREATE TABLE rnd (k text)",
    "CREATE INDEX rnd_k ON rnd (k)",
    "INSERT INTO rnd SELECT md5(random()::text) FROM generate_series(1, 1500)",
    "INSERT INTO rnd SELECT 'dup' FROM generate_series(1, 1500)",  # posting lists / dedup
    "DELETE FROM wide WHERE k < lpad('150', 700, 'x')",
    "VACUUM wide",
    # HOT and non-HOT updates
    "UPDATE big SET pad = pad + 1 WHERE id % 50 = 0",
    "UPDATE big SET v = v || 'x' WHERE id % 97 = 0",
    "UPDATE big SET id = id + 1000000 WHERE id % 101 = 0",
    # deletes + VACUUM (prune, vacuum, freeze, visible, btree vacuum and page deletion)
    "DELETE FROM big WHERE id BETWEEN 500 AND 2500",
    "DELETE FROM big WHERE id % 3 = 0",
    "DELETE FROM rnd WHERE k < '4'",
    "VACUUM big",
    "VACUUM rnd",
    "VACUUM FREEZE big",
    # posting-list splits: new 'dup' tuples land in freed heap space, below existing TIDs
    "INSERT INTO rnd SELECT 'dup' FROM generate_series(1, 400)",
    # bottom-up index deletion: version churn from non-HOT updates of the same rows
    "CREATE TABLE churn (id int PRIMARY KEY, v int)",
    "CREATE INDEX churn_v ON churn (v)",
    "INSERT INTO churn SELECT g, g FROM generate_series(1, 400) g",
    "UPDATE churn SET v = v + 1",
    "UPDATE churn SET v = v + 1",
    "UPDATE churn SET v = v + 1",
    "UPDATE churn SET v = v + 1",
    # an index that shrinks from level 2: page deletion up the tree, fast root moves
    "CREATE TABLE shrink (k text)",
    "CREATE INDEX shrink_k ON shrink (k)",
    "INSERT INTO shrink SELECT lpad(g::text, 700, '0') FROM generate_series(1, 400) g",
    "DELETE FROM shrink WHERE k > lpad('3', 700, '0')",
    "VACUUM shrink",
    "DELETE FROM shrink",
    "VACUUM shrink",
    # the lone leaf under the old root splits: the fast root link moves up (INSERT_META)
    "INSERT INTO shrink SELECT lpad(g::text, 700, '1') FROM generate_series(1, 60) g",
    # speculative insertion (Heap/CONFIRM) and ON CONFLICT updates
    "INSERT INTO big VALUES (1000001, 'new') ON CONFLICT (id) DO NOTHING",
    "INSERT INTO big SELECT g, 'upsert' FROM generate_series(2500, 2600) g ON CONFLICT (id) DO UPDATE SET pad = 7",
    "INSERT INTO big SELECT g, 'again' FROM generate_series(500, 800) g",
    # sequences
    "CREATE SEQUENCE s1 CACHE 1",
    "SELECT nextval('s1') FROM generate_series(1, 100)",
    "CREATE TABLE ser (id serial PRIMARY KEY, t text)",
    "INSERT INTO ser (t) SELECT 'x' FROM generate_series(1, 500)",
    # TOAST: incompressible values well past the toast threshold
    "CREATE TABLE toasty (id int, doc text)",
    "INSERT INTO toasty SELECT g, (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 200)) FROM generate_series(1, 30) g",
    "UPDATE toasty SET doc = doc || 'y' WHERE id % 4 = 0",
    "DELETE FROM toasty WHERE id % 3 = 0",
    "VACUUM toasty",
    # TRUNCATE, then use the new relfilenode
    "TRUNCATE ser",
    "INSERT INTO ser (t) SELECT 'y' FROM generate_series(1, 200)",
]

SUBXACT_SQL = """
BEGIN;
INSERT INTO ser (t) VALUES ('top');
SAVEPOINT a;
INSERT INTO ser (t) SELECT 'sub-a' FROM generate_series(1, 50);
ROLLBACK TO SAVEPOINT a;
SAVEPOINT b;
INSERT INTO ser (t) VALUES ('sub-b');
SAVEPOINT c;
UPDATE ser SET t = 'sub-c' WHERE id % 5 = 0;
RELEASE SAVEPOINT c;
RELEASE SAVEPOINT b;
COMMIT;
BEGIN;
INSERT INTO ser (t) VALUES ('doomed');
SAVEPOINT d;
INSERT INTO ser (t) VALUES ('doomed-sub');
COMMIT;
BEGIN;
INSERT INTO ser (t) VALUES ('rolled back');
ROLLBACK;
"""


def _run_workload(pg: PostgresInstance) -> None:
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-t", "150", "-c", "2", "-j", "1")
    for sql in WORKLOAD_SQL:
        pg.psql(sql)
    pg.psql(SUBXACT_SQL)
    # multixacts: two sessions share-lock the same rows, then one updates after the other ends
    with psycopg.connect(pg.dsn, autocommit=False) as c1, psycopg.connect(pg.dsn, autocommit=False) as c2:
        c1.execute("SELECT * FROM big WHERE id < 200 FOR SHARE").fetchall()
        c2.execute("SELECT * FROM big WHERE id < 200 FOR SHARE").fetchall()
        c2.execute("SELECT * FROM pgbench_branches FOR KEY SHARE").fetchall()
        c1.execute("SELECT * FROM pgbench_branches FOR SHARE").fetchall()
        c1.commit()
        c2.execute("UPDATE big SET pad = -1 WHERE id < 100")
        c2.commit()
        # a key-share lock follows a concurrent non-key update to the new version (LOCK_UPDATED)
        c1.execute("UPDATE big SET pad = -2 WHERE id = 1")
        c2.execute("SELECT * FROM big WHERE id = 1 FOR KEY SHARE").fetchall()
        c1.commit()
        c2.commit()
    pg.psql("VACUUM FREEZE big")


@pytest.fixture(scope="module")
def wal_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PostgresInstance, int, int]]:
    with pg_tmpdir("pagestore-redo-") as base:
        pg = PostgresInstance.create(base / "data", settings=SETTINGS)
        try:
            pg.start()
            pg.psql("CHECKPOINT")
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            t0 = time.monotonic()
            _run_workload(pg)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            pg.psql("CHECKPOINT")
            print(f"workload took {time.monotonic() - t0:.1f}s, WAL {(end - start) / 2**20:.1f} MiB")
            yield pg, start, end
        finally:
            pg.destroy()


def _records(pg: PostgresInstance, start: int, end: int) -> list[DecodedRecord]:
    return list(read_wal(pg.wal_dir(), start, end))


def test_every_verification_image_matches(wal_run: tuple[PostgresInstance, int, int]) -> None:
    pg, start, end = wal_run
    t0 = time.monotonic()
    report: VerifyReport = verify_records(read_wal(pg.wal_dir(), start, end))
    elapsed = time.monotonic() - t0
    print(report.summary())
    print(f"verified in {elapsed:.1f}s")
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.records > 1000
    must_have = [
        "Heap/INSERT", "Heap/HOT_UPDATE", "Heap/UPDATE", "Heap/DELETE", "Heap/LOCK", "Heap/INPLACE",
        "Heap2/PRUNE", "Heap2/VACUUM", "Heap2/FREEZE_PAGE", "Heap2/VISIBLE", "Heap2/MULTI_INSERT+INIT",
        "Btree/INSERT_LEAF", "Btree/INSERT_UPPER", "Btree/SPLIT_L", "Btree/SPLIT_R", "Btree/NEWROOT",
        "Btree/VACUUM", "Btree/DEDUP", "Btree/DELETE", "Btree/MARK_PAGE_HALFDEAD", "Btree/UNLINK_PAGE",
        "Btree/UNLINK_PAGE_META", "Heap/HEAP_CONFIRM", "Heap2/LOCK_UPDATED", "Sequence/LOG",
    ]
    missing = [m for m in must_have if not any(k.startswith(m) for k in report.checked)]
    assert not missing, f"workload did not exercise {missing}"


def test_clog_pages_equal_pg_xact(wal_run: tuple[PostgresInstance, int, int]) -> None:
    """CLOG page 0 from the xact records of the run, on top of pg_xact at the start LSN."""
    pg, start, end = wal_run
    # Every xid below the first one of the run was decided before start; take pg_xact as the
    # base and clear the run's xids so redo has to set them again.
    final = (pg.datadir / "pg_xact" / "0000").read_bytes()[:8192]
    base = bytearray(final)
    recs = [r for r in read_wal(pg.wal_dir(), start, end) if r.xl_rmid == RmgrId.XACT]
    xids: list[int] = []
    for r in recs:
        parsed = clog.parse_xact_xids(r.xl_info, r.xl_xid, r.main_data, r.end_lsn)
        if parsed is not None:
            xids += parsed[1]
    assert len(xids) > 100
    for xid in xids:
        clog.clog_set_status(base, xid, 0)
    mgr = PostgresRedoManager()
    from pageserver.storage.value import PostgresRecord

    page = mgr.apply_to_target(
        SlruPage(0, 0), bytes(base), [(r.end_lsn, PostgresRecord(False, r.raw)) for r in recs]
    )
    assert page == final
    statuses = {clog.clog_get_status(page, x) for x in xids}
    assert statuses == {clog.TRANSACTION_STATUS_COMMITTED, clog.TRANSACTION_STATUS_ABORTED}


def _rel_path(datadir: Path, spc: int, db: int, rel: int, fork: int) -> Path:
    suffix = ("", "_fsm", "_vm", "_init")[fork]
    if spc == 1664:
        return datadir / "global" / f"{rel}{suffix}"
    return datadir / "base" / str(db) / f"{rel}{suffix}"


def test_replayed_pages_equal_data_files(wal_run: tuple[PostgresInstance, int, int]) -> None:
    """After CHECKPOINT, every page the run touched equals PostgreSQL's data file page (masked)."""
    from pageserver.walredo.mask import btree_mask, fsm_vm_mask, heap_mask, masked

    pg, start, end = wal_run
    report = verify_records(read_wal(pg.wal_dir(), start, end))
    assert not report.failures
    compared = 0
    differ: list[str] = []
    for t, page in report.pages.items():
        if t.fork == 1:  # the FSM is not WAL-logged
            continue
        path = _rel_path(pg.datadir, t.spc, t.db, t.rel, t.fork)
        if not path.exists() or path.stat().st_size < (t.blkno + 1) * bp.BLCKSZ:
            continue  # dropped, truncated or rewritten since
        with path.open("rb") as f:
            f.seek(t.blkno * bp.BLCKSZ)
            disk = f.read(bp.BLCKSZ)
        if t.fork == 2 or bp.page_is_new(page):
            mask = fsm_vm_mask
        else:
            special = bp.BLCKSZ - bp.get_special(page)
            if special == 8:
                # A sequence page on disk holds the values handed out; WAL logs 32 ahead
                # (SEQ_LOG_VALS), so the data file never equals the logged page.
                continue
            mask = {0: heap_mask, 16: btree_mask}[special]
        compared += 1
        if masked(page, t.blkno, mask) != masked(disk, t.blkno, mask):
            differ.append(f"{t}")
    print(f"compared {compared} pages with the data files; {len(differ)} differ")
    assert compared > 1000
    assert not differ, differ[:20]


def test_a_wrong_redo_is_caught(wal_run: tuple[PostgresInstance, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a redo that writes one wrong byte per placed heap tuple (the
    placement kernel's INSERT/UPDATE and MULTI_INSERT entry points) is reported."""
    import itertools

    from pageserver.walredo import _heap_select as placement

    def flip_last_byte(page: bytearray, offnum: int) -> None:
        raw = bp.get_itemid(page, offnum)
        page[bp.lp_off(raw) + bp.lp_len(raw) - 1] ^= 0xFF

    real_put, real_multi = placement.put_tuple, placement.multi_insert

    def broken_put(page: bytearray, offnum: int, *args: object) -> None:
        real_put(page, offnum, *args)  # type: ignore[arg-type]
        flip_last_byte(page, offnum)

    def broken_multi(page: bytearray, *args: object) -> int:
        flags = real_multi(page, *args)  # type: ignore[arg-type]
        flip_last_byte(page, bp.max_offset(page))
        return flags

    monkeypatch.setattr(placement, "put_tuple", broken_put)
    monkeypatch.setattr(placement, "multi_insert", broken_multi)
    pg, start, end = wal_run
    report = verify_records(itertools.islice(read_wal(pg.wal_dir(), start, end), 3000), max_failures=5)
    assert report.failures and all("Heap" in f for f in report.failures), report.failures


def test_multixact_pages_equal_pg_multixact(wal_run: tuple[PostgresInstance, int, int]) -> None:
    """Offsets and members pages rebuilt from MultiXact/CREATE_ID records equal the files."""
    from pageserver.storage.value import PostgresRecord
    from pageserver.walredo import multixact as mx

    pg, start, end = wal_run
    recs = [
        r for r in read_wal(pg.wal_dir(), start, end)
        if r.xl_rmid == RmgrId.MULTIXACT and r.xl_info & 0xF0 == XLOG_MULTIXACT_CREATE_ID
    ]
    assert recs, "the FOR SHARE sessions made no multixact"
    offsets_file = (pg.datadir / "pg_multixact" / "offsets" / "0000").read_bytes()[:8192]
    members_file = (pg.datadir / "pg_multixact" / "members" / "0000").read_bytes()[:8192]
    off_base = bytearray(offsets_file)
    mem_base = bytearray(members_file)
    for r in recs:  # forget what the run wrote, so redo has to write it again
        mid, moff, members = mx.parse_create(r.main_data, r.end_lsn)
        mx.set_offset(off_base, 0, mid, 0)
        mx.set_members(mem_base, 0, moff, [(0, 0)] * len(members))
    values = [(r.end_lsn, PostgresRecord(False, r.raw)) for r in recs]
    mgr = PostgresRedoManager()
    assert mgr.apply_to_target(SlruPage(2, 0), bytes(off_base), values) == offsets_file
    assert mgr.apply_to_target(SlruPage(1, 0), bytes(mem_base), values) == members_file


SMALL_SQL = [
    "CREATE TABLE t2 (id int PRIMARY KEY, v text)",
    "INSERT INTO t2 SELECT g, md5(g::text) FROM generate_series(1, 3000) g",
    "CHECKPOINT",
    # after a checkpoint, reads that set hint bits log FPI_FOR_HINT (checksums are on)
    "SELECT count(*) FROM t2",
    "UPDATE t2 SET v = 'u' WHERE id % 5 = 0",
    "DELETE FROM t2 WHERE id % 7 = 0",
    "VACUUM t2",
    "CREATE INDEX t2_v ON t2 (v)",
]


def test_checksums_and_lz4_images() -> None:
    """A second cluster: data checksums (FPI_FOR_HINT, heap LSN on VISIBLE) and lz4 images."""
    from compute.postgres import initdb

    with pg_tmpdir("pagestore-redo-k-") as base:
        initdb(base / "data", extra_args=["--data-checksums"])
        pg = PostgresInstance(datadir=base / "data", settings={**SETTINGS, "wal_compression": "lz4"})
        try:
            pg.start()
            pg.psql("CHECKPOINT")
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            for sql in SMALL_SQL:
                pg.psql(sql)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            recs = list(read_wal(pg.wal_dir(), start, end))
        finally:
            pg.destroy()
    lz4 = sum(1 for r in recs for b in r.blocks if b.compression == "lz4")
    assert lz4 > 100
    report = verify_records(recs)
    print(report.summary())
    assert not report.failures, "\n".join(report.failures[:20])
    hints = sum(1 for r in recs if r.rmgr_name == "XLOG" and r.record_type == "FPI_FOR_HINT")
    print(f"lz4 images: {lz4}; FPI_FOR_HINT records: {hints}")
    assert hints > 0
