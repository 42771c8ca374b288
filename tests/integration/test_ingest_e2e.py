"""Issue 7 end to end, real processes only: a vanilla PostgreSQL 15 (endpoint + walproposer
bridge), 3 safekeepers and a pageserver whose WAL receiver ingests from them; the pageserver is
``kill -9``-ed while pgbench runs and restarted.

Flow: cluster (free ports) -> tenant create (bootstrap) -> endpoint -> ``pgbench -i -s 2`` ->
the pageserver flushes its timeline at D (``PUT .../checkpoint``) -> DDL part A (CREATE
DATABASE WAL_LOG with a table, TRUNCATE, DROP TABLE) -> pgbench -> ``kill -9`` of the pageserver
while pgbench runs -> restart (``cluster.start``) -> DDL part B (CREATE TABLE/INDEX, ALTER TABLE
ADD COLUMN with a constant and with a volatile default, CREATE DATABASE FILE_COPY, DROP
DATABASE) -> quiet -> CHECKPOINT.

Checked:
- the kill lost ingested WAL: the pageserver had ingested past D, ``index_part.json`` still says
  D; after the restart the WAL receiver asks the safekeepers for WAL from exactly D;
- the pageserver's ``last_record_lsn`` ends equal to PostgreSQL's ``pg_current_wal_flush_lsn()``
  (the server quiet, so the two can be compared for equality);
- Nblocks: every relation of every database in pg_class exists on the pageserver; every fork
  file on disk has the pageserver's Nblocks (FSM aside: not WAL-logged; a file longer than the
  pageserver's size only when its tail is pages PostgreSQL added without WAL, all new); dropped
  relations, the old relfilenodes of TRUNCATE and of the table rewrite, and the dropped
  database's relations do not exist on the pageserver any more;
- every page of every fork after CHECKPOINT equals the data file, masked as ``bufmask``
  (``bench.oracle.compare_snapshot``, shared with the oracle test, which covers redo at depth),
  and every SLRU page byte for byte. One exception PostgreSQL itself makes: VM pages of a
  database created with ``STRATEGY wal_log`` (and of copies of it) are logged with the bitmap as
  the page "hole", so replay has them without bits; those must have lost bits only, never
  gained any (``vm_bits_only_lost``);
- nothing lost or applied twice: a read-only endpoint booted from a basebackup at the final LSN
  shows the primary's ``sum(abalance)``, ``count(*)`` of ``pgbench_history`` and the DDL tables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio

from bench.oracle import (
    FORK_NAMES,
    Fork,
    Snapshot,
    SnapshotResult,
    catalog_rels,
    compare_snapshot,
    list_forks,
)
from compute import postgres
from compute.page_client import PageClient
from control_plane import cluster, endpoint, process
from control_plane.http_client import request_json
from control_plane.local_env import LocalEnv, plan_ports
from pageserver.basebackup import read_datadir_block
from pageserver.pgdatadir import BLCKSZ, DEFAULTTABLESPACE_OID, GLOBALTABLESPACE_OID
from pageserver.walredo.mask import fsm_vm_mask
from protocol.ids import TenantId, TimelineId
from protocol.lsn import format_lsn, parse_lsn
from protocol.pagestream import MAX_LSN, ExistsRequest, ExistsResponse, RelTag, Request

SCALE = 2
PGBENCH_SECONDS = 15  # long enough that the kill lands mid-run even on a slow CI machine
KILL_AFTER_S = 3.0
QUIET = lambda _msg: None  # noqa: E731


@attrs.define
class Run:
    env: LocalEnv
    tenant: str
    timeline: str
    port: int
    pgdata: Path

    def dsn(self, db: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={postgres.PG_USER} dbname={db}"

    def info(self) -> dict[str, Any]:
        return cluster.timeline_info(self.env, self.tenant, self.timeline)

    def index_part(self) -> dict[str, Any]:
        path = (self.env.pageserver_dir / "tenants" / self.tenant / "timelines" / self.timeline
                / "index_part.json")
        doc: dict[str, Any] = json.loads(path.read_text())
        return doc

    def pageserver_pid(self) -> int | None:
        return process.running_pid(self.env.pageserver_dir / "pid")


@pytest.fixture
def run(pg_tmp_path: Path) -> Iterator[Run]:
    cfg = attrs.evolve(plan_ports(3, free_ports=True), safekeeper_no_sync=True)
    env = LocalEnv.create(pg_tmp_path / "cluster", cfg)
    try:
        cluster.start(env, log=QUIET)
        t = cluster.create_tenant(env, None, None, set_default=True)
        # full: its files, PostgreSQL's own, are the oracle (a lazy endpoint's are the pageserver's)
        ep = endpoint.start_endpoint(env, "main", storage="full", log=QUIET)
        yield Run(env, t["tenant_id"], str(t["timeline_id"]), ep.spec.port, ep.pgdata)
    finally:
        cluster.stop(env, immediate=True, log=QUIET)


def one(conn: psycopg.Connection[Any], sql: str, *args: Any) -> Any:
    row = conn.execute(sql, args or None).fetchone()
    assert row is not None, sql
    return row[0]


def wal_receiver_starts(log_path: Path) -> list[str]:
    """The start LSNs of the WAL receiver's sessions, in order (the pageserver's JSON log)."""
    starts = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "receiving WAL":
            starts.append(str(rec["start"]))
    return starts


def ddl_part_a(conn: psycopg.Connection[Any], run: Run) -> dict[str, RelTag]:
    """DDL between the flush at D and the kill: re-ingested after the restart. Returns the
    relations that must no longer exist at the end."""
    x = conn.execute
    db = int(one(conn, "SELECT oid FROM pg_database WHERE datname = 'postgres'"))
    gone: dict[str, RelTag] = {}
    x("CREATE DATABASE e2e_db STRATEGY wal_log")
    with psycopg.connect(run.dsn("e2e_db"), autocommit=True) as c2:
        c2.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c2.execute("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 3000) g")
    x("CREATE TABLE e2e_trunc AS SELECT g AS id, md5(g::text) AS v FROM generate_series(1, 4000) g")
    gone["e2e_trunc before TRUNCATE"] = RelTag(DEFAULTTABLESPACE_OID, db, int(one(
        conn, "SELECT pg_relation_filenode('e2e_trunc')")), 0)
    x("TRUNCATE e2e_trunc")
    x("INSERT INTO e2e_trunc SELECT g, 'after' FROM generate_series(1, 500) g")
    x("CREATE TABLE e2e_drop (id int PRIMARY KEY)")
    x("INSERT INTO e2e_drop SELECT generate_series(1, 2000)")
    gone["e2e_drop"] = RelTag(DEFAULTTABLESPACE_OID, db, int(one(conn, "SELECT pg_relation_filenode('e2e_drop')")), 0)
    gone["e2e_drop_pkey"] = RelTag(DEFAULTTABLESPACE_OID, db, int(one(
        conn, "SELECT pg_relation_filenode('e2e_drop_pkey')")), 0)
    x("DROP TABLE e2e_drop")
    x("CREATE SEQUENCE e2e_seq INCREMENT 3")
    x("SELECT nextval('e2e_seq') FROM generate_series(1, 40)")
    return gone


def ddl_part_b(conn: psycopg.Connection[Any], run: Run) -> dict[str, RelTag]:
    """DDL after the restart."""
    x = conn.execute
    db = int(one(conn, "SELECT oid FROM pg_database WHERE datname = 'postgres'"))
    gone: dict[str, RelTag] = {}
    x("CREATE TABLE e2e_t (id int PRIMARY KEY, v text)")
    x("INSERT INTO e2e_t SELECT g, md5(g::text) FROM generate_series(1, 5000) g")
    x("CREATE INDEX e2e_t_v ON e2e_t (v)")
    x("ALTER TABLE e2e_t ADD COLUMN c int NOT NULL DEFAULT 7")  # catalog only (attmissingval)
    old = int(one(conn, "SELECT pg_relation_filenode('e2e_t')"))
    x("ALTER TABLE e2e_t ADD COLUMN r float8 DEFAULT random()")  # volatile: the table is rewritten
    assert int(one(conn, "SELECT pg_relation_filenode('e2e_t')")) != old, "ADD COLUMN random() did not rewrite"
    gone["e2e_t before the rewrite"] = RelTag(DEFAULTTABLESPACE_OID, db, old, 0)
    x("CREATE DATABASE e2e_copy TEMPLATE e2e_db STRATEGY file_copy")
    x("CREATE DATABASE e2e_gone")
    gone_db = int(one(conn, "SELECT oid FROM pg_database WHERE datname = 'e2e_gone'"))
    with psycopg.connect(run.dsn("e2e_gone"), autocommit=True) as c2:
        c2.execute("CREATE TABLE g (id int)")
        c2.execute("INSERT INTO g SELECT generate_series(1, 1000)")
        gone["e2e_gone.g"] = RelTag(DEFAULTTABLESPACE_OID, gone_db, int(one(c2, "SELECT pg_relation_filenode('g')")), 0)
        gone["e2e_gone.pg_class"] = RelTag(DEFAULTTABLESPACE_OID, gone_db, int(one(
            c2, "SELECT pg_relation_filenode('pg_class')")), 0)
    x("DROP DATABASE e2e_gone")
    return gone


def start_pgbench(run: Run) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ([] if os.geteuid() != 0 else ["runuser", "-u", postgres.PG_USER, "--"])
        + [postgres.pg_binary("pgbench"), "-h", "127.0.0.1", "-p", str(run.port), "-U", postgres.PG_USER,
           "-n", "-c", "2", "-j", "2", "-T", str(PGBENCH_SECONDS), "postgres"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def data_of(dsn: str) -> tuple[int, int, int, str, str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT count(*) FROM pgbench_history), "
            "(SELECT sum(delta) FROM pgbench_history), "
            "(SELECT count(*) || '/' || sum(c) || '/' || count(r) || '/' || md5(string_agg(v, ',' ORDER BY id)) "
            " FROM e2e_t), "
            "(SELECT count(*) || '/' || min(v) FROM e2e_trunc)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), str(row[3]), str(row[4])


VM_HEADER = 24  # SizeOfPageHeaderData: the bitmap follows it


def vm_bits_only_lost(served: bytes, local: bytes) -> bool:
    """The served VM page is the file's with some all-visible/all-frozen bits clear, none set
    extra (a missing bit costs a heap visit; an extra one would be corruption)."""
    if served.count(0) == BLCKSZ:
        return True  # read as a new page: an empty bitmap
    a, b = bytearray(served), bytearray(local)
    fsm_vm_mask(a, 0)
    fsm_vm_mask(b, 0)
    if a[:VM_HEADER] != b[:VM_HEADER]:
        return False
    return all(x & ~y == 0 for x, y in zip(a[VM_HEADER:], b[VM_HEADER:], strict=True))


async def recheck_wal_log_vm(client: PageClient, snap: Snapshot, res: SnapshotResult,
                             wal_log_dbs: set[int]) -> int:
    """CREATE DATABASE ... STRATEGY wal_log logs every copied page with ``log_newpage_buffer(buf,
    true)`` (RelationCopyStorageUsingBuffer, PostgreSQL 15): a VM page is "standard" with
    pd_lower = 24 and pd_upper = 8192, so its whole bitmap is the omitted hole and replay
    (PostgreSQL's own, and ours) gets the page with no bit set. Those forks' mismatches are
    taken out of ``res`` only when the served page has lost bits and gained none; returns how
    many pages that was."""
    forks = {f"{f.describe()} at ": f for f in list_forks(snap)
             if f.rel.forknum == 2 and f.rel.dbnode in wal_log_dbs}
    kept, lost = [], 0
    for m in res.mismatches:
        fork: Fork | None = next((f for p, f in forks.items() if m.startswith(p)), None)
        block = m.split(": block ", 1)[1].split(":", 1)[0] if ": block " in m else ""
        if fork is None or not block.isdigit() or "bytes differ after the vm mask" not in m:
            kept.append(m)
            continue
        blkno = int(block)
        served = await client.get_page(fork.rel, blkno, MAX_LSN, snap.lsn)
        if vm_bits_only_lost(served, read_datadir_block(snap.root, fork.rel, blkno)):
            lost += 1
        else:
            kept.append(m + " (and it has all-visible/frozen bits the file does not have)")
    res.mismatches[:] = kept
    return lost


async def pagestream_checks(run: Run, snap: Snapshot, gone: dict[str, RelTag], wal_log_dbs: set[int]
                            ) -> tuple[SnapshotResult, list[str], int, int]:
    """The full comparison, plus existence of every pg_class relation and absence of the gone."""
    problems: list[str] = []
    async with await PageClient.connect("127.0.0.1", run.env.config.pageserver.pg,
                                        TenantId.parse(run.tenant), TimelineId.parse(run.timeline),
                                        **run.env.page_client_auth(run.tenant)) as client:
        for what, rel in gone.items():
            if await client.exists(rel, MAX_LSN, snap.lsn):
                problems.append(f"{what} ({rel.spcnode}/{rel.dbnode}/{rel.relnode}) still exists on the pageserver")
        # pg_class side: a permanent relation has its main fork on the pageserver, and the
        # pageserver has no fork the data directory lacks (the file side is compare_snapshot's).
        on_disk = {f.rel for f in list_forks(snap)}
        rels = [(info, RelTag(GLOBALTABLESPACE_OID if db == 0 else DEFAULTTABLESPACE_OID, db, relnode, fork))
                for (db, relnode), info in sorted(snap.rels.items()) if info.persistence == "p"
                for fork in range(4)]
        reqs: list[Request] = [ExistsRequest(client.next_reqid(), MAX_LSN, snap.lsn, rel) for _, rel in rels]
        responses = await client.pipelined(reqs, 32)
        for (info, rel), resp in zip(rels, responses, strict=True):
            assert isinstance(resp, ExistsResponse), resp
            where = f"{info.name} ({rel.spcnode}/{rel.dbnode}/{rel.relnode}) fork {FORK_NAMES[rel.forknum]}"
            if rel.forknum == 0 and not resp.exists:
                problems.append(f"{where} is in pg_class but not on the pageserver")
            elif resp.exists and rel not in on_disk:
                problems.append(f"{where} exists on the pageserver but has no file")
        checked = len(rels) // 4
        res = await compare_snapshot(client, snap)
        vm_lost = await recheck_wal_log_vm(client, snap, res, wal_log_dbs)
    return res, problems, checked, vm_lost


@pytest.mark.postgres
@pytest.mark.slow
def test_ingest_end_to_end_with_pageserver_kill(run: Run) -> None:
    started = time.monotonic()
    env = run.env
    pg = postgres.PostgresInstance(run.pgdata, port=run.port, started=True)
    ps_log = env.pageserver_dir / "pageserver.log"
    with psycopg.connect(run.dsn(), autocommit=True) as conn:
        # No worker may change a page between the CHECKPOINT and reading the files.
        conn.execute("ALTER SYSTEM SET autovacuum = off")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # catalog_rels reads its pg_class
        pg.pgbench("-i", "-s", str(SCALE), "-q")

        # D: the pageserver's flushed state once it has pgbench -i.
        init_lsn = parse_lsn(str(one(conn, "SELECT pg_current_wal_flush_lsn()")))
        cluster.wait_for_lsn(env, run.tenant, run.timeline, init_lsn, timeout=120)
        flushed = request_json("PUT", f"{env.pageserver_http}/v1/tenant/{run.tenant}/timeline/{run.timeline}"
                                      "/checkpoint", None, timeout=120)
        d = parse_lsn(flushed["disk_consistent_lsn"])
        assert d >= init_lsn and parse_lsn(run.index_part()["disk_consistent_lsn"]) == d

        gone = ddl_part_a(conn, run)

        part_a = parse_lsn(str(one(conn, "SELECT pg_current_wal_flush_lsn()")))

        # kill -9 the pageserver while pgbench runs and the pageserver ingests it, once it has
        # ingested past part A (so there is something unflushed to lose on any machine speed).
        bench = start_pgbench(run)
        try:
            bench_started = time.monotonic()
            cluster.wait_for_lsn(env, run.tenant, run.timeline, part_a, timeout=60)
            time.sleep(max(0.0, KILL_AFTER_S - (time.monotonic() - bench_started)))
            assert bench.poll() is None, "pgbench ended before the kill: the kill would not be mid-ingest"
            ingested = parse_lsn(run.info()["last_record_lsn"])
            pid = run.pageserver_pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            process.wait_until("the killed pageserver to be gone", lambda: not process.is_alive(pid), timeout=10)
            flush_at_kill = parse_lsn(str(one(conn, "SELECT pg_current_wal_flush_lsn()")))
            on_disk = parse_lsn(run.index_part()["disk_consistent_lsn"])
            # The kill lost ingested WAL that only the in-memory layer held.
            assert on_disk == d < ingested <= flush_at_kill, (format_lsn(d), format_lsn(ingested))
            sessions_before = len(wal_receiver_starts(ps_log))
            restarted = time.monotonic()
            cluster.start(env, log=QUIET)
            after = run.info()
            assert parse_lsn(after["disk_consistent_lsn"]) == d
            assert parse_lsn(after["last_record_lsn"]) >= d
            # Re-ingest of what the kill lost (pgbench still writing meanwhile).
            cluster.wait_for_lsn(env, run.tenant, run.timeline, flush_at_kill, timeout=120)
            catch_up_s = time.monotonic() - restarted
        finally:
            out, _ = bench.communicate(timeout=120)
        assert bench.returncode == 0, out.decode(errors="replace")
        # Ingest resumed from disk_consistent_lsn: the first session after the restart asked
        # the safekeepers for WAL from exactly D.
        process.wait_until("the restarted pageserver's WAL receiver",
                           lambda: len(wal_receiver_starts(ps_log)) > sessions_before, timeout=30)
        assert wal_receiver_starts(ps_log)[sessions_before] == format_lsn(d)

        gone |= ddl_part_b(conn, run)

        # Quiet: the pageserver ends exactly at PostgreSQL's flush LSN.
        for _ in range(20):
            final = parse_lsn(str(one(conn, "SELECT pg_current_wal_flush_lsn()")))
            cluster.wait_for_lsn(env, run.tenant, run.timeline, final, timeout=120)
            last = parse_lsn(run.info()["last_record_lsn"])
            if parse_lsn(str(one(conn, "SELECT pg_current_wal_flush_lsn()"))) == final:
                break  # nothing was written meanwhile (a standby snapshot, say)
        else:
            pytest.fail("PostgreSQL never stayed quiet")
        assert last == final, f"pageserver at {format_lsn(last)}, PostgreSQL flushed {format_lsn(final)}"
        primary = data_of(run.dsn())
        assert primary[1] > 0 and primary[3].startswith("5000/35000/5000/")

        # The files: catalogs before the CHECKPOINT (catalog reads may prune pages), then the
        # CHECKPOINT writes every dirty buffer, and the pageserver gets its WAL too.
        rels = catalog_rels(run.dsn)
        wal_log_dbs = {int(r[0]) for r in conn.execute(
            "SELECT oid FROM pg_database WHERE datname IN ('e2e_db', 'e2e_copy')").fetchall()}
        assert len(wal_log_dbs) == 2
        conn.execute("CHECKPOINT")
        ckpt = parse_lsn(str(one(conn, "SELECT pg_current_wal_flush_lsn()")))
        cluster.wait_for_lsn(env, run.tenant, run.timeline, ckpt, timeout=120)

    snap = Snapshot("final", ckpt, run.pgdata, rels, latest=True)
    res, problems, checked, vm_lost = trio.run(pagestream_checks, run, snap, gone, wal_log_dbs)
    print(json.dumps({**res.as_json(), "pg_class_relations": checked, "gone": len(gone),
                      "wal_log_vm_pages_bits_lost": vm_lost,
                      "kill": {"disk_consistent_lsn": format_lsn(d), "ingested_before_kill": format_lsn(ingested),
                               "flush_at_kill": format_lsn(flush_at_kill),
                               "restart_to_flush_at_kill_s": round(catch_up_s, 1)}}))
    assert not problems, "\n".join(problems)
    assert checked > 1000 and res.forks > checked
    # Every relation of every database: Nblocks equal to the file, except the FSM and
    # forks PostgreSQL extended without WAL (their tail checked to be new pages).
    assert res.nblocks_equal + res.nblocks_file_longer + res.fsm_nblocks_differ == res.forks, res.as_json()
    assert not res.mismatches, f"{len(res.mismatches)} mismatches:\n" + "\n".join(res.mismatches[:40])
    assert res.equal == res.pages - Counter({"vm": vm_lost}) and res.slru_equal == res.slru_pages
    assert {"heap", "btree", "vm", "sequence"} <= set(res.pages) and sum(res.pages.values()) > 4000

    # Nothing lost or applied twice: the data of a basebackup at the final LSN is the primary's.
    check = endpoint.start_endpoint(env, "check", lsn=format_lsn(final), log=QUIET)
    assert data_of(f"host=127.0.0.1 port={check.spec.port} user={postgres.PG_USER} dbname=postgres") == primary
    with psycopg.connect(f"host=127.0.0.1 port={check.spec.port} user={postgres.PG_USER} dbname=e2e_copy") as c:
        assert one(c, "SELECT count(*) || '/' || sum(id) FROM t") == "3000/4501500"
    print(json.dumps({"seconds": round(time.monotonic() - started, 1)}))


def test_vm_bits_only_lost() -> None:
    """The VM exception of the e2e test accepts lost bits only."""
    file = bytearray(BLCKSZ)
    file[12:16] = (24).to_bytes(2, "little") + (BLCKSZ).to_bytes(2, "little")  # pd_lower, pd_upper
    file[18:20] = (0x2004).to_bytes(2, "little")  # pd_pagesize_version
    file[VM_HEADER:VM_HEADER + 3] = b"\xff\x0f\x03"
    served = bytearray(file)
    served[0:8] = b"\x01" * 8  # another LSN: masked
    served[VM_HEADER:VM_HEADER + 3] = b"\x00\x00\x00"
    assert vm_bits_only_lost(bytes(served), bytes(file))
    served[VM_HEADER + 1] = 0x0F
    assert vm_bits_only_lost(bytes(served), bytes(file))
    served[VM_HEADER + 1] = 0x1F  # a bit the file does not have
    assert not vm_bits_only_lost(bytes(served), bytes(file))
    served[VM_HEADER + 1] = 0x0F
    served[VM_HEADER + 4000] = 0x01
    assert not vm_bits_only_lost(bytes(served), bytes(file))
    served[VM_HEADER + 4000] = 0
    served[15] = 0x1F  # pd_upper differs: not the same page
    assert not vm_bits_only_lost(bytes(served), bytes(file))
    assert vm_bits_only_lost(bytes(BLCKSZ), bytes(file))  # a new page: no bit at all
