"""Commit timestamps (``track_commit_timestamp = on``) through pagestore.

A primary endpoint with ``track_commit_timestamp = on`` (its first start writes
XLOG/PARAMETER_CHANGE, which turns the tracking on for ingest) commits transactions: plain ones,
one with 70 subtransactions (some rolled back), one under a replication origin, and one prepared
and committed later (COMMIT_PREPARED). Then, at a CHECKPOINT's LSN:

- the basebackup's ``pg_commit_ts`` segments are byte for byte the endpoint's files;
- a branch at that LSN boots from it and answers ``pg_xact_commit_timestamp_origin`` for every
  one of those xids exactly as the endpoint does (time and origin id).

Unit tests of the commit record parsing and the entry layout sit beside it.
"""

from __future__ import annotations

import io
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path

import attrs
import psycopg
import pytest

from compute.postgres import PG_USER
from control_plane import cluster, endpoint
from control_plane.local_env import LocalEnv, plan_ports
from pageserver.walredo import commit_ts
from pageserver.walredo.errors import RedoError
from protocol.lsn import format_lsn, parse_lsn
from protocol.wal.rmgr import (
    XACT_XINFO_HAS_ORIGIN,
    XACT_XINFO_HAS_SUBXACTS,
    XLOG_XACT_ABORT,
    XLOG_XACT_COMMIT,
    XLOG_XACT_HAS_INFO,
)

ON = {"track_commit_timestamp": "on", "max_prepared_transactions": "5"}


def test_parse_commit_and_entries() -> None:
    main = struct.pack("<qIi3I", 123456789, XACT_XINFO_HAS_SUBXACTS | XACT_XINFO_HAS_ORIGIN, 3, 901, 902, 1700)
    main += struct.pack("<Qq", 0xABCDEF, 987654321)  # xl_xact_origin: its timestamp wins
    parsed = commit_ts.parse_commit(XLOG_XACT_COMMIT | XLOG_XACT_HAS_INFO, 900, main, 0)
    assert parsed == (987654321, [900, 901, 902, 1700])
    plain = commit_ts.parse_commit(XLOG_XACT_COMMIT, 5, struct.pack("<q", 42), 0)
    assert plain == (42, [5])
    assert commit_ts.parse_commit(XLOG_XACT_ABORT, 5, struct.pack("<q", 42), 0) is None
    with pytest.raises(RedoError, match="truncated"):
        commit_ts.parse_commit(XLOG_XACT_COMMIT | XLOG_XACT_HAS_INFO, 900, main[:20], 0)
    page = bytearray(8192)
    commit_ts.set_entries(page, 1, [900, 901, 1700], 77, 3)  # 1700 is on page 2: not here
    assert commit_ts.COMMIT_TS_XACTS_PER_PAGE == 819
    assert commit_ts.get_entry(page, 900) == (77, 3) and commit_ts.get_entry(page, 901) == (77, 3)
    assert page[(900 - 819) * 10:(902 - 819) * 10] == struct.pack("<qH", 77, 3) * 2
    assert page.count(0) == 8192 - sum(1 for b in struct.pack("<qH", 77, 3) * 2 if b)
    assert commit_ts.commit_ts_page_precedes(1, 2) and not commit_ts.commit_ts_page_precedes(2, 1)


@pytest.mark.postgres
@pytest.mark.slow
def test_commit_timestamps_on_a_branch(pg_tmp_path: Path) -> None:
    cfg = attrs.evolve(plan_ports(1, free_ports=True), safekeeper_no_sync=True)
    env = LocalEnv.create(pg_tmp_path / "cluster", cfg)
    quiet: Callable[[str], None] = lambda _msg: None  # noqa: E731
    cluster.start(env, log=quiet)
    try:
        t = cluster.create_tenant(env, None, None, set_default=True)
        tenant, timeline = t["tenant_id"], str(t["timeline_id"])
        ep = endpoint.start_endpoint(env, "main", settings=ON, log=quiet)
        dsn = f"host=127.0.0.1 port={ep.spec.port} user={PG_USER} dbname=postgres"
        xids: list[int] = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            x = conn.execute
            x("CREATE TABLE ct (id int, note text)")
            for i in range(5):
                row = x("INSERT INTO ct VALUES (%s, 'plain') RETURNING txid_current()", (i,)).fetchone()
                assert row is not None
                xids.append(int(row[0]))
            x("BEGIN")
            for i in range(70):
                x(f"SAVEPOINT s{i}")
                x("INSERT INTO ct VALUES (%s, 'sub')", (100 + i,))
                if i % 4 == 0:
                    x(f"ROLLBACK TO SAVEPOINT s{i}")
            row = x("SELECT txid_current()").fetchone()
            assert row is not None
            xids.append(int(row[0]))
            x("COMMIT")
            x("SELECT pg_replication_origin_create('ct_origin')")
            x("SELECT pg_replication_origin_session_setup('ct_origin')")
            x("BEGIN")
            x("SELECT pg_replication_origin_xact_setup('0/AB', '2020-02-02 02:02:02+00')")
            row = x("INSERT INTO ct VALUES (-1, 'origin') RETURNING txid_current()").fetchone()
            assert row is not None
            xids.append(int(row[0]))
            x("COMMIT")
            x("SELECT pg_replication_origin_session_reset()")
            x("BEGIN")
            row = x("INSERT INTO ct VALUES (-2, 'prepared') RETURNING txid_current()").fetchone()
            assert row is not None
            xids.append(int(row[0]))
            x("PREPARE TRANSACTION 'ct_gid'")
            x("COMMIT PREPARED 'ct_gid'")
            # subtransaction xids committed with their parent: find them through the rows
            sub = x("SELECT DISTINCT xmin::text::bigint FROM ct WHERE note = 'sub'").fetchall()
            xids += [int(r[0]) for r in sub]
            query = ("SELECT x, (pg_xact_commit_timestamp_origin(x::text::xid)).* FROM unnest(%s::bigint[]) x "
                     "ORDER BY x")
            expect = x(query, (xids,)).fetchall()
            assert all(ts is not None for _x, ts, _o in expect), expect
            assert any(o != 0 for _x, _ts, o in expect), expect  # the origin's commit
            x("CHECKPOINT")
            row = x("SELECT pg_current_wal_insert_lsn()").fetchone()
            assert row is not None
            lsn = parse_lsn(str(row[0]))
        cluster.wait_for_lsn(env, tenant, timeline, lsn, timeout=120)

        tar_path = pg_tmp_path / "bb.tar"
        endpoint.fetch_basebackup(env, tenant, timeline, lsn, tar_path)
        with tarfile.open(tar_path) as tar:
            served = {m.name.split("/")[-1]: tar.extractfile(m).read()  # type: ignore[union-attr]
                      for m in tar.getmembers() if m.name.startswith("pg_commit_ts/") and m.isfile()}
        local = {f.name: f.read_bytes() for f in (ep.pgdata / "pg_commit_ts").iterdir() if f.is_file()}
        assert served and served.keys() == local.keys(), (served.keys(), local.keys())
        for name, data in local.items():
            assert io.BytesIO(served[name]).getvalue() == data, name

        cluster.branch(env, tenant, "ct-branch", "main", format_lsn(lsn))
        br = endpoint.start_endpoint(env, "branch", branch="ct-branch", settings=ON, log=quiet)
        try:
            bdsn = f"host=127.0.0.1 port={br.spec.port} user={PG_USER} dbname=postgres"
            with psycopg.connect(bdsn, autocommit=True) as conn:
                assert conn.execute(query, (xids,)).fetchall() == expect
        finally:
            endpoint.stop_endpoint(env, "branch", mode="immediate", log=quiet)
    finally:
        cluster.stop(env, immediate=True, log=quiet)
