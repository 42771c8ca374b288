"""WAL ingest end to end, in-process, from a real PostgreSQL 15.

A timeline is bootstrapped from an initdb directory; a vanilla PostgreSQL runs on a copy of
that same directory and W's ``WalReceiver`` streams its WAL (START_REPLICATION PHYSICAL,
straight from PostgreSQL) into the timeline while pgbench, DDL, CREATE/DROP DATABASE,
TRUNCATE, subtransactions, rollbacks, sequences and multixacts run. Then, with PostgreSQL shut
down cleanly (so its files are final):

- ``last_record_lsn`` reaches PostgreSQL's final WAL position (its shutdown checkpoint);
- the relation directories list exactly the relation files on disk (FSM forks aside: the FSM
  is not WAL-logged), and every fork's size equals the file's;
- every page whose latest value is an image equals the file page, masked (G's masks);
- with G's redo plugged in, every main and VM page is compared the same way; the test
  prints how many matched and requires all of them to;
- a second timeline fed by the same stream is "killed" mid-ingest (its unflushed in-memory
  layer dropped, the tenant reloaded from disk) and resumes from ``disk_consistent_lsn``: it
  ends at the same ``last_record_lsn`` with the same values as the first.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import trio

from compute.postgres import PostgresInstance, chown_to_postgres
from pageserver.import_datadir import import_datadir, run_initdb
from pageserver.pg_control import parse_control_file
from pageserver.pgdatadir import (
    DEFAULTTABLESPACE_OID,
    GLOBALTABLESPACE_OID,
    Datadir,
    RelTag,
)
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import (
    CHECKPOINT_KEY,
    SLRU_CLOG,
    SLRU_MULTIXACT_MEMBERS,
    SLRU_MULTIXACT_OFFSETS,
    Key,
)
from pageserver.storage.value import Image, Value
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from pageserver.wal_receiver import WalReceiverConfig
from pageserver.walingest import TimelineWalIngest
from pageserver.walredo.manager import PostgresRedoManager
from pageserver.walredo.mask import btree_mask, fsm_vm_mask, heap_mask, masked, seq_mask
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn, parse_lsn

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CONFIG = StorageConfig(checkpoint_distance=8 * 1024 * 1024)
_REL = re.compile(r"^(\d+)(?:_(fsm|vm|init))?(?:\.(\d+))?$")
_FORK = {None: 0, "fsm": 1, "vm": 2, "init": 3}
SETTINGS = {
    "wal_level": "replica",
    "full_page_writes": "on",
    "wal_keep_size": "1GB",
    "max_wal_senders": "4",
    "autovacuum": "off",
    "fsync": "off",
    # At shutdown a walsender waits until the receiver reports the WAL flushed; this one
    # reports disk_consistent_lsn, so don't let PostgreSQL wait the default 60 s for it.
    "wal_sender_timeout": "5s",
}


def _track_kinds(tl: Timeline, kinds: dict[Key, bool]) -> None:
    """Remember, per key, whether the latest value put is an image."""
    orig = tl.put

    async def put(key: Key, lsn: Lsn, value: Value) -> None:
        kinds[key] = isinstance(value, Image)
        await orig(key, lsn, value)

    tl.put = put  # type: ignore[method-assign]


def _disk_rels(pgdata: Path) -> dict[RelTag, int]:
    """Relation forks on disk and their sizes in blocks (FSM forks left out)."""
    out: dict[RelTag, int] = {}
    places = [("global", GLOBALTABLESPACE_OID, 0)]
    places += [
        (f"base/{d}", DEFAULTTABLESPACE_OID, int(d)) for d in os.listdir(pgdata / "base") if d.isdigit()
    ]
    for sub, spc, db in places:
        for name in os.listdir(pgdata / sub):
            m = _REL.match(name)
            if not m or m.group(2) == "fsm":
                continue
            rel = RelTag(spc, db, int(m.group(1)), _FORK[m.group(2)])
            size = (pgdata / sub / name).stat().st_size
            assert size % 8192 == 0
            seg = int(m.group(3) or 0)
            out[rel] = max(out.get(rel, 0), seg * 131072 + size // 8192)
    return out


def _file_of(pgdata: Path, rel: RelTag) -> Path:
    sub = "global" if rel.spc == GLOBALTABLESPACE_OID else f"base/{rel.db}"
    return pgdata / sub / (f"{rel.rel}" + ("", "_fsm", "_vm", "_init")[rel.fork])


def _mask_for(rel: RelTag, page: bytes) -> Callable[[bytearray, int], None] | None:
    """The page's resource-manager mask; ``None`` for sequence pages, whose tuple nextval
    changes without WAL (it logs values 32 ahead), so the file never equals the WAL's page."""
    if rel.fork == 2:
        return fsm_vm_mask
    special = int.from_bytes(page[16:18], "little")
    if special == 8192:
        return heap_mask
    if special == 8192 - 16:
        return btree_mask
    if special == 8192 - 8:
        return None
    raise AssertionError(f"{rel}: unexpected page kind (pd_special {special})")


async def _timeline_rels(dd: Datadir, lsn: Lsn) -> set[RelTag]:
    rels: set[RelTag] = set()
    for spc, db in await dd.list_dbs(lsn):
        rels |= {r for r in await dd.list_rels(spc, db, lsn) if r.fork != 1}
    return rels


def _workload_part1(pg: PostgresInstance) -> None:
    pg.pgbench("-i", "-s", "2", "-q")


def _workload_part2(pg: PostgresInstance) -> None:
    pg.pgbench("-c", "1", "-t", "500", "-n")
    pg.psql(
        "CREATE TABLE t1 (id int PRIMARY KEY, v text);"
        "INSERT INTO t1 SELECT g, repeat('x', 80) FROM generate_series(1, 5000) g;"
        "CREATE INDEX t1_v ON t1 (v);"
        "UPDATE t1 SET v = 'y' || id WHERE id % 10 = 0;"
        "DELETE FROM t1 WHERE id % 7 = 0;"
    )
    pg.psql("VACUUM t1")


def _workload_part3(pg: PostgresInstance) -> None:
    t0 = time.monotonic()
    pg.psql(
        "CREATE TABLE t2 AS SELECT g FROM generate_series(1, 10000) g;"
        "CREATE TABLE t3 (a int); INSERT INTO t3 SELECT generate_series(1, 1000);"
        "CREATE SEQUENCE s1; SELECT nextval('s1') FROM generate_series(1, 50);"
    )
    pg.psql("TRUNCATE t2")
    pg.psql("INSERT INTO t2 SELECT generate_series(1, 100)")
    pg.psql("DROP TABLE t3")
    pg.psql(
        "BEGIN; INSERT INTO t1 VALUES (100001, 'a'); SAVEPOINT s;"
        "INSERT INTO t1 VALUES (100002, 'b'); RELEASE s; SAVEPOINT s2;"
        "INSERT INTO t1 VALUES (100003, 'c'); ROLLBACK TO s2; COMMIT;"
    )
    pg.psql("BEGIN; INSERT INTO t1 VALUES (100004, 'd'); ROLLBACK;")
    _multixact(pg)
    print(f"part3 {time.monotonic() - t0:.1f}s: checkpoint")
    pg.psql("CHECKPOINT")
    print(f"part3 {time.monotonic() - t0:.1f}s: checkpoint done")
    # after a checkpoint every first touch of a page carries a full-page image
    pg.pgbench("-c", "1", "-t", "200", "-n")
    print(f"part3 {time.monotonic() - t0:.1f}s: create db")
    pg.psql("CREATE DATABASE db_wal")
    pg.psql("CREATE TABLE x (a int PRIMARY KEY); INSERT INTO x SELECT generate_series(1, 500)", dbname="db_wal")
    pg.psql("CREATE DATABASE db_copy STRATEGY FILE_COPY")
    pg.psql("CREATE DATABASE db_gone")
    pg.psql("DROP DATABASE db_gone")
    pg.psql("VACUUM FREEZE")
    print(f"part3 {time.monotonic() - t0:.1f}s: done")


def _multixact(pg: PostgresInstance) -> None:
    """Two transactions share-locking one row create a multixact."""
    dsn = pg.dsn
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        a.execute("SELECT * FROM pgbench_branches WHERE bid = 1 FOR SHARE").fetchall()
        b.execute("SELECT * FROM pgbench_branches WHERE bid = 1 FOR SHARE").fetchall()
        a.commit()
        b.commit()


async def _wait_for(pred: Callable[[], bool], what: str, timeout: float = 90) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.05)


async def _in_thread(fn: Callable[[], None]) -> None:
    await trio.to_thread.run_sync(fn)


async def _run_ingest(
    nursery: trio.Nursery, tl: Timeline, port: int
) -> tuple[trio.CancelScope, TimelineWalIngest]:
    cfg = WalReceiverConfig(safekeepers=(("127.0.0.1", port),), idle_timeout_s=30)
    ing = TimelineWalIngest(tl, cfg)
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await ing.run()

    nursery.start_soon(run)
    return scope, ing


async def _flush_lsn(pg: PostgresInstance) -> Lsn:
    out = await trio.to_thread.run_sync(pg.psql, "SELECT pg_current_wal_flush_lsn()")
    return parse_lsn(out)


def _content_known(rel: RelTag, wal_log_dbs: set[int]) -> bool:
    """CREATE DATABASE ... WAL_LOG logs each copied page as a standard page, and a VM page's
    bitmap lies in what a standard page calls its hole: the WAL carries a VM page of zeros
    while PostgreSQL's copy keeps the bits. Those pages cannot match the files."""
    return not (rel.fork == 2 and rel.db in wal_log_dbs)


async def _compare_with_files(
    tl: Timeline, pgdata: Path, wal_log_dbs: set[int]
) -> tuple[int, int, int]:
    """Sizes and pages of the timeline vs the data files; returns (pages compared, of which
    image-latest, relations)."""
    dd = Datadir(tl)
    lsn = tl.last_record_lsn
    disk = _disk_rels(pgdata)
    mine = await _timeline_rels(dd, lsn)
    assert mine == set(disk), (
        f"only in timeline: {sorted(map(str, mine - set(disk)))[:10]}; "
        f"only on disk: {sorted(map(str, set(disk) - mine))[:10]}"
    )
    compared = 0
    mismatched: list[str] = []
    for rel in sorted(disk):
        n = disk[rel]
        assert await dd.get_rel_size(rel, lsn) == n, f"{rel}: {n} blocks on disk"
        data = _file_of(pgdata, rel).read_bytes() if n else b""
        if not _content_known(rel, wal_log_dbs):
            continue
        for start in range(0, n, 128):
            blknos = list(range(start, min(n, start + 128)))
            pages = await dd.get_pages(rel, blknos, lsn)
            for b, page in zip(blknos, pages, strict=True):
                file_page = data[b * 8192 : (b + 1) * 8192]
                mask = _mask_for(rel, file_page)
                if mask is None:
                    seq_mask(bytearray(page), b)  # still a sane page
                    continue
                if masked(page, b, mask) != masked(file_page, b, mask):
                    special = int.from_bytes(file_page[16:18], "little")
                    mismatched.append(f"{rel} blk {b} (pd_special {special})")
                compared += 1
    print(f"pages compared with the files: {compared}, mismatched: {len(mismatched)}")
    assert not mismatched, mismatched[:20]
    return compared, len(mismatched), len(disk)


async def _image_latest_pages_match(
    tl: Timeline, pgdata: Path, kinds: dict[Key, bool], wal_log_dbs: set[int]
) -> int:
    dd = Datadir(tl)
    lsn = tl.last_record_lsn
    disk = _disk_rels(pgdata)
    n_img = 0
    for rel, n in sorted(disk.items()):
        data = _file_of(pgdata, rel).read_bytes() if n else b""
        from pageserver.storage.key import rel_block_key

        blknos = [
            b for b in range(n) if kinds.get(rel_block_key(rel.spc, rel.db, rel.rel, rel.fork, b))
        ]
        if not blknos or not _content_known(rel, wal_log_dbs):
            continue
        for b, page in zip(blknos, await dd.get_pages(rel, blknos, lsn), strict=True):
            file_page = data[b * 8192 : (b + 1) * 8192]
            mask = _mask_for(rel, file_page)
            if mask is None:
                continue
            assert masked(page, b, mask) == masked(file_page, b, mask), f"{rel} blk {b}"
            n_img += 1
    return n_img


async def _all_values(tl: Timeline) -> dict[str, bytes]:
    dd = Datadir(tl)
    lsn = tl.last_record_lsn
    out: dict[str, bytes] = {"dbdir": repr(sorted((await dd.list_dbs(lsn)).items())).encode()}
    out["checkpoint"] = await tl.get(CHECKPOINT_KEY, lsn)
    for spc, db in await dd.list_dbs(lsn):
        for rel in sorted(await dd.list_rels(spc, db, lsn)):
            n = await dd.get_rel_size(rel, lsn)
            out[f"{rel} size"] = n.to_bytes(4, "little")
            for b, page in enumerate(await dd.get_pages(rel, list(range(n)), lsn)):
                out[f"{rel} {b}"] = page
    for kind in (SLRU_CLOG, SLRU_MULTIXACT_OFFSETS, SLRU_MULTIXACT_MEMBERS):
        for segno in sorted(await dd.list_slru_segments(kind, lsn)):
            out[f"slru {kind} {segno}"] = await dd.get_slru_segment(kind, segno, lsn)
    return out


async def test_ingest_from_postgres_with_restart(pg_tmp_path: Path) -> None:
    init = pg_tmp_path / "init"
    await run_initdb(init)
    pgdata = pg_tmp_path / "pg"
    shutil.copytree(init, pgdata, symlinks=True)
    chown_to_postgres(pgdata)
    os.chmod(pgdata, 0o700)
    pg = PostgresInstance(datadir=pgdata, settings=dict(SETTINGS))
    kinds: dict[Key, bool] = {}
    t0 = time.monotonic()
    tid_b = TenantId.generate()
    tl_id = TimelineId.generate()
    try:
        async with trio.open_nursery() as nursery:
            redo = PostgresRedoManager()
            tenant_a = Tenant(pg_tmp_path / "a", TenantId.generate(), CONFIG, redo=redo, nursery=nursery)
            tl_a = await tenant_a.create_timeline(tl_id)
            _track_kinds(tl_a, kinds)
            res = await import_datadir(tl_a, init)
            tenant_b = Tenant(pg_tmp_path / "b", tid_b, CONFIG, redo=redo, nursery=nursery)
            tl_b = await tenant_b.create_timeline(tl_id)
            await import_datadir(tl_b, init)
            await tl_b.flush()
            assert tl_a.last_record_lsn == tl_b.last_record_lsn == res.end_lsn

            await trio.to_thread.run_sync(pg.start)
            scope_a, ing_a = await _run_ingest(nursery, tl_a, pg.port)
            scope_b, ing_b = await _run_ingest(nursery, tl_b, pg.port)

            print(f"{time.monotonic() - t0:.1f}s: await _in_thread(lambda: _workload_part1")
            await _in_thread(lambda: _workload_part1(pg))
            lsn1 = await _flush_lsn(pg)
            await _wait_for(lambda: tl_b.last_record_lsn >= lsn1, "timeline B at part 1")
            flushed = await ing_b.flush()
            assert flushed >= lsn1

            print(f"{time.monotonic() - t0:.1f}s: await _in_thread(lambda: _workload_part2")
            await _in_thread(lambda: _workload_part2(pg))
            lsn2 = await _flush_lsn(pg)
            await _wait_for(lambda: tl_b.last_record_lsn >= lsn2, "timeline B at part 2")
            # "kill" B: its in-memory layer (everything after `flushed`) is lost
            scope_b.cancel()
            reached = tl_b.last_record_lsn
            assert reached > flushed
            await tenant_b.shutdown()
            tenant_b = await Tenant.load(pg_tmp_path / "b", tid_b, CONFIG, redo=redo, nursery=nursery)
            tl_b = tenant_b.timelines[tl_id]
            assert tl_b.last_record_lsn == flushed
            scope_b, ing_b = await _run_ingest(nursery, tl_b, pg.port)

            print(f"{time.monotonic() - t0:.1f}s: await _in_thread(lambda: _workload_part3")
            await _in_thread(lambda: _workload_part3(pg))
            wal_log_dbs = {
                int(await trio.to_thread.run_sync(pg.psql, f"SELECT oid FROM pg_database WHERE datname = '{name}'"))
                for name in ("db_wal",)
            }
            print(f"{time.monotonic() - t0:.1f}s: stop")
            # Fast shutdown writes a shutdown checkpoint; the walsenders then wait until the
            # receivers report it flushed, so keep flushing until PostgreSQL is down.
            async with trio.open_nursery() as stopper:
                stopped = trio.Event()

                async def stop() -> None:
                    await trio.to_thread.run_sync(pg.stop)
                    stopped.set()

                stopper.start_soon(stop)
                while not stopped.is_set():
                    await ing_a.flush()
                    await ing_b.flush()
                    with trio.move_on_after(0.2):
                        await stopped.wait()
            print(f"{time.monotonic() - t0:.1f}s: stopped")
            cf = parse_control_file((pgdata / "global/pg_control").read_bytes())
            await _wait_for(lambda: tl_a.last_record_lsn > cf.checkpoint, "timeline A at the end")
            await _wait_for(lambda: tl_b.last_record_lsn > cf.checkpoint, "timeline B at the end")
            scope_a.cancel()
            scope_b.cancel()
            print(f"{time.monotonic() - t0:.1f}s: caught up")
            print(
                f"ingested {ing_a.ingest.stats.records} records up to "
                f"{format_lsn(tl_a.last_record_lsn)} ({ing_a.ingest.stats.images} images, "
                f"{ing_a.ingest.stats.wal_records} raw records)"
            )
            assert tl_a.last_record_lsn == tl_b.last_record_lsn

            print(f"{time.monotonic() - t0:.1f}s: n_img = await _image_latest_pages_match(")
            n_img = await _image_latest_pages_match(tl_a, pgdata, kinds, wal_log_dbs)
            print(f"image-latest pages equal to the files (masked): {n_img}")
            assert n_img > 1000
            print(f"{time.monotonic() - t0:.1f}s: await _compare_with_files(tl_a, pgdata)")
            await _compare_with_files(tl_a, pgdata, wal_log_dbs)

            print(f"{time.monotonic() - t0:.1f}s: values_a = await _all_values(tl_a)")
            values_a = await _all_values(tl_a)
            values_b = await _all_values(tl_b)
            assert values_a.keys() == values_b.keys()
            differ = [k for k in values_a if values_a[k] != values_b[k]]
            assert not differ, differ[:10]
            print(f"{time.monotonic() - t0:.1f}s: nursery.cancel_scope.cancel()")
            nursery.cancel_scope.cancel()
            await tenant_a.shutdown()
            await tenant_b.shutdown()
    finally:
        await trio.to_thread.run_sync(lambda: pg.stop("immediate"))


