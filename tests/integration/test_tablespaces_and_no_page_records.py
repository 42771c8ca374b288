"""Tablespaces, and records without page effects, from a real PostgreSQL through pagestore.

On a primary endpoint: three in-place tablespaces (one stays empty, one is dropped after a table
moved through it), a table and its index in one, a database created in it, logical messages
(transactional and not), a replication origin with a transaction committed under it and its
progress advanced. Then at a CHECKPOINT's LSN:

- every page of every fork, those under ``pg_tblspc/`` included, equals the endpoint's file
  (``bench.oracle.compare_snapshot``, masked as PostgreSQL's redo checks);
- a branch at that LSN, a lazy endpoint (the default), boots from its basebackup (tablespaces
  in place under ``pg_tblspc``, served by its page filesystem), shows the same data and
  tablespaces, and writes into the empty tablespace and the database in the tablespace
  (their directories are there).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import attrs
import psycopg
import pytest
import trio

from bench.oracle import Snapshot, SnapshotResult, catalog_rels, compare_snapshot, list_forks
from bench.standby import Standby
from compute.page_client import PageClient
from compute.postgres import PG_USER
from control_plane import cluster, endpoint
from control_plane.local_env import LocalEnv, plan_ports
from protocol.ids import TenantId, TimelineId
from protocol.lsn import format_lsn, parse_lsn

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SETUP = [
    "SET allow_in_place_tablespaces = on",
    "CREATE TABLESPACE ts_a LOCATION ''",
    "CREATE TABLESPACE ts_empty LOCATION ''",
    "CREATE TABLESPACE ts_gone LOCATION ''",
    "CREATE TABLE t_ts (id int PRIMARY KEY USING INDEX TABLESPACE ts_a, v text) TABLESPACE ts_a",
    "INSERT INTO t_ts SELECT g, md5(g::text) FROM generate_series(1, 3000) g",
    "CREATE INDEX t_ts_v ON t_ts (v) TABLESPACE ts_a",
    "DELETE FROM t_ts WHERE id % 10 = 0",
    "VACUUM t_ts",
    "CREATE TABLE t_moved (id int, v text)",
    "INSERT INTO t_moved SELECT g, 'm' || g FROM generate_series(1, 500) g",
    "ALTER TABLE t_moved SET TABLESPACE ts_gone",
    "ALTER TABLE t_moved SET TABLESPACE pg_default",
    "DROP TABLESPACE ts_gone",
    "CREATE DATABASE db_ts TABLESPACE ts_a",
    # records without page effects
    "SELECT pg_logical_emit_message(true, 'pagestore', 'transactional')",
    "SELECT pg_logical_emit_message(false, 'pagestore', repeat('x', 20000))",
    "SELECT pg_replication_origin_create('origin_a')",
    "SELECT pg_replication_origin_advance('origin_a', '0/12345678')",
]
ORIGIN_TXN = [
    "SELECT pg_replication_origin_session_setup('origin_a')",
    "BEGIN",
    "SELECT pg_replication_origin_xact_setup('0/23456789', now())",
    "INSERT INTO t_moved VALUES (-1, 'under an origin')",
    "COMMIT",
    "SELECT pg_replication_origin_session_reset()",
]
CHECK = ("SELECT (SELECT count(*) || ' ' || sum(id) FROM t_ts), (SELECT count(*) FROM t_moved), "
         "(SELECT string_agg(spcname, ',' ORDER BY spcname) FROM pg_tablespace), "
         "(SELECT count(*) FROM t_ts WHERE v = md5('77'))")


def _one(dsn: str, sql: str) -> tuple[object, ...]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return tuple(row)


def test_tablespaces_messages_origins(pg_tmp_path: Path) -> None:
    cfg = attrs.evolve(plan_ports(1, free_ports=True), safekeeper_no_sync=True, validate_redo=True)
    env = LocalEnv.create(pg_tmp_path / "cluster", cfg)
    quiet: Callable[[str], None] = lambda _msg: None  # noqa: E731
    cluster.start(env, log=quiet)
    try:
        t = cluster.create_tenant(env, None, None, set_default=True)
        tenant, timeline = t["tenant_id"], str(t["timeline_id"])
        # full: its files, PostgreSQL's own, are the oracle (a lazy endpoint's are the pageserver's)
        ep = endpoint.start_endpoint(env, "main", storage="full", log=quiet)

        def dsn(db: str = "postgres", port: int = ep.spec.port) -> str:
            return f"host=127.0.0.1 port={port} user={PG_USER} dbname={db}"

        standby = Standby.start(pg_tmp_path / "standby", ep.spec.port)
        with psycopg.connect(dsn(), autocommit=True) as conn:
            conn.execute("SET wal_consistency_checking = 'all'")
            for sql in SETUP + ORIGIN_TXN:
                conn.execute(sql)
        with psycopg.connect(dsn("db_ts"), autocommit=True) as conn:
            conn.execute("CREATE TABLE in_db_ts AS SELECT g AS id FROM generate_series(1, 700) g")
        expect = _one(dsn(), CHECK)
        assert expect == ("2700 4050000", 501, "pg_default,pg_global,ts_a,ts_empty", 1)
        with psycopg.connect(dsn(), autocommit=True) as conn:
            conn.execute("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # to read its pg_class
            rels = catalog_rels(dsn)
            conn.execute("ALTER DATABASE template0 ALLOW_CONNECTIONS false")
            conn.execute("CHECKPOINT")
            row = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        assert row is not None
        lsn = parse_lsn(str(row[0]))
        cluster.wait_for_lsn(env, tenant, timeline, lsn, timeout=120)

        standby.replay_to(lsn)
        standby.stop()
        snap = Snapshot("tablespaces", lsn, ep.pgdata, rels, reference=standby.root)

        async def compare() -> SnapshotResult:
            async with await PageClient.connect("127.0.0.1", env.config.pageserver.pg,
                                                TenantId.parse(tenant), TimelineId.parse(timeline),
                                                **env.page_client_auth(tenant)) as client:
                return await compare_snapshot(client, snap)

        res = trio.run(compare)
        assert not res.mismatches, "\n".join(res.mismatches[:20])
        assert res.pages["heap"] > 100 and res.pages["btree"] > 10, res.as_json()
        # CREATE DATABASE's WAL_LOG copy logs VM pages without their bits: PostgreSQL's standby
        # has the very same pages, and only those are let through
        assert res.vm_bits_lost_as_postgres > 10, res.as_json()
        # the table, its indexes and the database in ts_a were among the forks compared
        spc_a = int(str(_one(dsn(), "SELECT oid FROM pg_tablespace WHERE spcname = 'ts_a'")[0]))
        in_ts = {(f.rel.dbnode, f.info.name if f.info else "?") for f in list_forks(snap) if f.rel.spcnode == spc_a}
        assert {"postgres.t_ts", "postgres.t_ts_pkey", "postgres.t_ts_v", "db_ts.in_db_ts"} <= {n for _, n in in_ts}, in_ts

        cluster.branch(env, tenant, "at-checkpoint", "main", format_lsn(lsn))
        br = endpoint.start_endpoint(env, "branch", branch="at-checkpoint", log=quiet)
        try:
            assert _one(dsn(port=br.spec.port), CHECK) == expect
            assert _one(dsn("db_ts", br.spec.port), "SELECT count(*), sum(id) FROM in_db_ts") == (700, 245350)
            tblspc = br.pgdata / "pg_tblspc"
            spc_empty = str(_one(dsn(), "SELECT oid FROM pg_tablespace WHERE spcname = 'ts_empty'")[0])
            assert sorted(p.name for p in tblspc.iterdir()) == sorted([str(spc_a), spc_empty])
            assert all(p.is_dir() and not p.is_symlink() for p in tblspc.iterdir())
            assert br.spec.storage == "lazy" and os.path.ismount(br.dir / "pagefs" / "mnt")
            with psycopg.connect(dsn(port=br.spec.port), autocommit=True) as conn:
                conn.execute("CREATE TABLE in_empty TABLESPACE ts_empty AS SELECT 1 AS x")
                conn.execute("INSERT INTO t_ts VALUES (0, 'branch')")
                row = conn.execute("SELECT (SELECT count(*) FROM in_empty), (SELECT count(*) FROM t_ts), "
                                   "pg_tablespace_location((SELECT oid FROM pg_tablespace "
                                   "WHERE spcname = 'ts_a'))").fetchone()
            assert row == (1, 2701, f"pg_tblspc/{spc_a}")
            with psycopg.connect(dsn("db_ts", br.spec.port), autocommit=True) as conn:
                conn.execute("INSERT INTO in_db_ts VALUES (0)")
        finally:
            endpoint.stop_endpoint(env, "branch", mode="immediate", log=quiet)
    finally:
        cluster.stop(env, immediate=True, log=quiet)
