"""Lazy endpoints (``endpoint start --storage lazy``): a vanilla PostgreSQL 15 whose relation
files are the page filesystem over the page service, with real nodes.

- pgbench on a lazy primary with a 2 MiB local cache (pages are evicted while it runs); then
  PostgreSQL restarts on the same mount with every page evicted from the local cache and from
  the kernel's page cache: every page comes back from the page service at the LSN the rules
  say, and the data is consistent (sums, amcheck on the btree indexes);
- kill -9 of PostgreSQL and of the page filesystem: PostgreSQL gets I/O errors; ``endpoint
  start`` again: every acknowledged transaction is there;
- a branch and a read-only endpoint at a past LSN, lazy, answer exactly as main did then;
- an unlogged table is empty after a restart and works;
- CREATE DATABASE with WAL_LOG and FILE_COPY, DROP DATABASE;
- in-place tablespaces in the page filesystem (a table, its index and a database in one),
  served from the page service after a restart; DROP TABLESPACE;
- kill -9 of the pageserver: a read waits for it to come back and is answered;
- without /dev/fuse a lazy start fails naming it and ``--storage full``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from compute.postgres import PostgresError, PostgresInstance
from control_plane import cli, endpoint
from control_plane.local_env import LocalEnv
from control_plane.process import is_alive, read_pid, wait_until
from tests.integration.cli_json import pagestore_json

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="needs /dev/fuse and root"),
]


def pagestore(capsys: pytest.CaptureFixture[str], *args: str) -> None:
    capsys.readouterr()
    rc = cli.main(list(args))
    assert rc == 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from tests.tmpdirs import pg_tmpdir

    with pg_tmpdir("pagestore-lazy-") as base:
        workdir = base / "cluster"
        assert cli.main(["init", "--workdir", str(workdir), "--free-ports", "--no-sync"]) == 0
        toml = workdir / "pagestore.toml"
        toml.write_text(toml.read_text().replace("local_cache_size = 1073741824", "local_cache_size = 2097152"))
        assert cli.main(["start", "--workdir", str(workdir)]) == 0
        assert cli.main(["tenant", "create", "--workdir", str(workdir)]) == 0
        try:
            yield workdir
        finally:
            cli.main(["stop", "--workdir", str(workdir), "--immediate"])
            # `stop` unmounts every page filesystem, also of endpoints whose PostgreSQL died
            assert not [m for m in workdir.glob("endpoints/*/pagefs/mnt") if os.path.ismount(m)]


def pg_of(cluster: Path, name: str) -> PostgresInstance:
    spec = json.loads((cluster / "endpoints" / name / "endpoint.json").read_text())
    return PostgresInstance(cluster / "endpoints" / name / "pgdata", port=spec["port"], started=True)


def pagefs_http(cluster: Path, name: str, method: str, path: str) -> Any:
    st = json.loads((cluster / "endpoints" / name / "pagefs-status.json").read_text())
    req = urllib.request.Request(f"http://127.0.0.1:{st['http_port']}{path}", method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def consistent(pg: PostgresInstance) -> tuple[int, int]:
    """(count of pgbench_history, sum of abalance), after checking the invariants pgbench keeps
    and the btree indexes."""
    out = pg.psql(
        "SELECT (SELECT count(*) FROM pgbench_history), (SELECT sum(abalance) FROM pgbench_accounts), "
        "(SELECT sum(delta) FROM pgbench_history), (SELECT sum(bbalance) FROM pgbench_branches), "
        "(SELECT count(*) FROM pgbench_accounts)"
    )
    n, accounts, history, branches, rows = (int(x) for x in out.split("|"))
    assert accounts == history == branches, out
    assert rows == 100000
    pg.psql("CREATE EXTENSION IF NOT EXISTS amcheck")
    pg.psql("SELECT bt_index_check(c.oid, true) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_am a ON a.oid = c.relam WHERE a.amname = 'btree' AND c.relpersistence = 'p'")
    return n, accounts


def test_lazy_primary_eviction_crash_and_restart(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = ["--workdir", str(cluster)]
    ep = pagestore_json(capsys, "endpoint", "start", "main", *wd, "--storage", "lazy")
    assert ep["storage"] == "lazy" and ep["start_seconds"] > 0 and ep["pagefs_pid"]
    pgdata = cluster / "endpoints/main/pgdata"
    assert (pgdata / "base").is_symlink() and os.path.ismount(cluster / "endpoints/main/pagefs/mnt")
    assert not list((cluster / "endpoints/main/pagefs/backing/base").glob("*/1259"))  # no relation data here
    main = pg_of(cluster, "main")
    assert main.psql("SHOW wal_log_hints") == "on"
    main.pgbench("-i", "-s", "1", "-q")
    out = main.pgbench("-n", "-c", "2", "-T", "4")
    acked = int(next(line for line in out.splitlines() if "actually processed" in line).split(":")[1].split("/")[0])
    assert acked > 0, out
    main.psql("VACUUM pgbench_accounts")  # sets VM bits and PD_ALL_VISIBLE (kept local: H1, H2)
    n_before, sum_before = consistent(main)
    assert n_before == acked
    st = pagefs_http(cluster, "main", "GET", "/v1/status")
    assert st["evictions"] > 0 and st["bytes_cached"] <= 2 * 1024 * 1024 + 64 * 8192, st
    assert st["kept"]["vm_page"] > 0

    # PostgreSQL restarts on the same page filesystem, which drops everything the rules allow
    # (and the kernel's cached pages): the data is read back from the page service.
    spec = endpoint.load_endpoint(LocalEnv.load(cluster), "main").spec
    main.stop("fast")
    wait_until("safekeepers hold the shutdown checkpoint",
               lambda: pagefs_http(cluster, "main", "GET", "/v1/status")["durable_lsn"]
               >= pagefs_http(cluster, "main", "GET", "/v1/status")["start_lsn"], timeout=10)
    time.sleep(1.5)  # the bridge's status file (the durable LSN) is rewritten every second
    evicted = pagefs_http(cluster, "main", "POST", "/v1/evict")["evicted"]
    assert evicted > 0
    misses = pagefs_http(cluster, "main", "GET", "/v1/status")["misses"]
    restarted = PostgresInstance(pgdata, port=spec.port, settings=endpoint._settings(spec))
    restarted.start()
    assert consistent(restarted) == (n_before, sum_before)
    assert pagefs_http(cluster, "main", "GET", "/v1/status")["misses"] > misses

    # kill -9 of PostgreSQL and of the page filesystem
    restarted.pgbench("-n", "-c", "2", "-T", "3")
    n_acked, sum_acked = consistent(restarted)
    pg_pid = int((pgdata / "postmaster.pid").read_text().split()[0])
    fs_pid = read_pid(cluster / "endpoints/main/pagefs.pid")
    assert fs_pid is not None
    os.kill(fs_pid, signal.SIGKILL)
    # ENOTCONN, or ECONNABORTED for a request the daemon had in hand when it died
    with pytest.raises(PostgresError, match=r"Transport endpoint is not connected|Software caused connection abort|I/O error"):
        restarted.psql("SELECT count(*) FROM pgbench_accounts", timeout=30)
    os.kill(pg_pid, signal.SIGKILL)
    wait_until("postmaster gone", lambda: not endpoint.load_endpoint(LocalEnv.load(cluster), "main").running(),
               timeout=30)
    ep = pagestore_json(capsys, "endpoint", "start", "main", *wd, "--storage", "lazy")
    assert ep["running"] and ep["storage"] == "lazy"
    again = pg_of(cluster, "main")
    assert consistent(again) == (n_acked, sum_acked)


def test_lazy_branch_and_past_lsn(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = ["--workdir", str(cluster)]
    main = pg_of(cluster, "main")
    past = main.psql("SELECT (SELECT count(*) FROM pgbench_history), (SELECT sum(abalance) FROM pgbench_accounts), "
                     "pg_current_wal_insert_lsn()")
    past_n, past_sum, past_lsn = past.split("|")
    main.pgbench("-n", "-c", "1", "-t", "50")
    snap = main.psql("BEGIN; LOCK TABLE pgbench_accounts, pgbench_history IN EXCLUSIVE MODE; "
                     "SELECT (SELECT count(*) FROM pgbench_history), (SELECT sum(abalance) FROM pgbench_accounts), "
                     "pg_current_wal_insert_lsn(); COMMIT;").splitlines()[-1]
    half_n, half_sum, half_lsn = snap.split("|")
    main.pgbench("-n", "-c", "1", "-t", "50")
    pagestore(capsys, "timeline", "branch", *wd, "--branch-name", "half", "--ancestor-lsn", half_lsn)
    pagestore_json(capsys, "endpoint", "start", "half", *wd, "--branch-name", "half", "--storage", "lazy")
    half = pg_of(cluster, "half")
    assert half.psql("SELECT (SELECT count(*) FROM pgbench_history), (SELECT sum(abalance) FROM pgbench_accounts)") \
        == f"{half_n}|{half_sum}"
    half.psql("UPDATE pgbench_accounts SET abalance = abalance + 7 WHERE aid = 3")  # a primary of its own
    ep = pagestore_json(capsys, "endpoint", "start", "past", *wd, "--lsn", past_lsn, "--storage", "lazy")
    assert ep["read_only"] and ep["storage"] == "lazy" and ep["bridge_pid"] is None
    old = pg_of(cluster, "past")
    assert old.psql("SELECT (SELECT count(*) FROM pgbench_history), (SELECT sum(abalance) FROM pgbench_accounts)") \
        == f"{past_n}|{past_sum}"
    pagestore(capsys, "endpoint", "stop", "past", *wd)
    pagestore(capsys, "endpoint", "stop", "half", *wd)
    assert not os.path.ismount(cluster / "endpoints/past/pagefs/mnt")


def test_unlogged_table_is_empty_after_a_restart(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = ["--workdir", str(cluster)]
    main = pg_of(cluster, "main")
    main.psql("CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY, v text)")
    main.psql("INSERT INTO scratch SELECT g, repeat('x', 100) FROM generate_series(1, 5000) g")
    main.psql("CREATE TABLE kept AS SELECT 1 AS one")
    assert main.psql("SELECT count(*) FROM scratch") == "5000"
    pagestore(capsys, "endpoint", "stop", "main", *wd)
    pagestore_json(capsys, "endpoint", "start", "main", *wd, "--storage", "lazy")
    main = pg_of(cluster, "main")
    assert main.psql("SELECT count(*) FROM scratch") == "0"
    assert main.psql("SELECT one FROM kept") == "1"
    main.psql("INSERT INTO scratch VALUES (1, 'again')")
    assert main.psql("SELECT v FROM scratch WHERE id = 1") == "again"


def test_create_and_drop_database(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CREATE DATABASE with both strategies (WAL_LOG; FILE_COPY, whose pages stay local: H4),
    DROP DATABASE, and a restart that reads the new databases from the page service."""
    wd = ["--workdir", str(cluster)]
    cli.main(["endpoint", "stop", "main", *wd])  # one primary per branch (it may not exist yet)
    pagestore_json(capsys, "endpoint", "start", "db", *wd, "--storage", "lazy")
    main = pg_of(cluster, "db")
    main.psql("CREATE DATABASE walcopy")
    main.psql("CREATE DATABASE filecopy STRATEGY FILE_COPY")
    main.psql("CREATE DATABASE dropped")
    for db in ("walcopy", "filecopy"):
        main.psql("CREATE TABLE t AS SELECT g FROM generate_series(1, 20000) g", dbname=db)
    main.psql("DROP DATABASE dropped")
    st = pagefs_http(cluster, "db", "GET", "/v1/status")
    assert st["kept"]["new_database"] > 0, st
    pagestore(capsys, "endpoint", "stop", "db", *wd)
    pagestore_json(capsys, "endpoint", "start", "db", *wd, "--storage", "lazy")
    main = pg_of(cluster, "db")
    for db in ("walcopy", "filecopy"):
        assert main.psql("SELECT count(*), sum(g) FROM t", dbname=db) == "20000|200010000"
    assert main.psql("SELECT count(*) FROM pg_database WHERE datname = 'dropped'") == "0"
    pagestore(capsys, "endpoint", "stop", "db", *wd)


def test_tablespaces_on_a_lazy_endpoint(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In-place tablespaces (``pg_tblspc/<spc>`` in the page filesystem): CREATE TABLESPACE, a
    table and its index and a database in it, with the 2 MiB cache evicting (the database's
    copy alone is ~1200 pages); a restart serves them from the page service (the listing names
    the tablespace); DROP TABLESPACE. The endpoint starts without ``--storage``: lazy is the
    default."""
    wd = ["--workdir", str(cluster)]
    ep = pagestore_json(capsys, "endpoint", "start", "ts", *wd)
    assert ep["storage"] == "lazy"
    pg = pg_of(cluster, "ts")
    with psycopg.connect(f"host=127.0.0.1 port={ep['port']} user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute("SET allow_in_place_tablespaces = on")
        conn.execute("CREATE TABLESPACE lazy_ts LOCATION ''")
    pg.psql("CREATE TABLE in_ts (id int PRIMARY KEY USING INDEX TABLESPACE lazy_ts, v text) TABLESPACE lazy_ts")
    pg.psql("INSERT INTO in_ts SELECT g, md5(g::text) FROM generate_series(1, 10000) g")
    pg.psql("CREATE DATABASE db_in_ts TABLESPACE lazy_ts")
    pg.psql("CREATE TABLE t AS SELECT g FROM generate_series(1, 5000) g", dbname="db_in_ts")
    spc = pg.psql("SELECT oid FROM pg_tablespace WHERE spcname = 'lazy_ts'")
    assert pg.psql("SELECT pg_tablespace_location(oid) FROM pg_tablespace WHERE spcname = 'lazy_ts'") \
        == f"pg_tblspc/{spc}"  # in place, as on a plain PostgreSQL
    mnt_spc = cluster / "endpoints/ts/pagefs/mnt/pg_tblspc" / spc
    assert mnt_spc.is_dir() and list(mnt_spc.glob("PG_15_*/*/PG_VERSION"))  # the tablespace is in the mount
    pg.psql("CHECKPOINT")  # the pages reach the page filesystem, more than its cache holds
    assert pagefs_http(cluster, "ts", "GET", "/v1/status")["evictions"] > 0
    pagestore(capsys, "endpoint", "stop", "ts", *wd)
    pagestore_json(capsys, "endpoint", "start", "ts", *wd)
    pg = pg_of(cluster, "ts")
    assert pg.psql("SELECT count(*), sum(id), count(DISTINCT v) FROM in_ts") == "10000|50005000|10000"
    assert pg.psql("SELECT v FROM in_ts WHERE id = 777") == "f1c1592588411002af340cbaedd6fc33"  # md5('777'), by the index
    assert pg.psql("SELECT count(*), sum(g) FROM t", dbname="db_in_ts") == "5000|12502500"
    assert pagefs_http(cluster, "ts", "GET", "/v1/status")["misses"] > 0
    pg.psql("DROP DATABASE db_in_ts")
    pg.psql("DROP TABLE in_ts")
    pg.psql("DROP TABLESPACE lazy_ts")
    assert not mnt_spc.exists()
    pagestore(capsys, "endpoint", "stop", "ts", *wd)


def test_a_pageserver_restart_is_a_pause_for_a_lazy_endpoint(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kill -9 of the pageserver under a lazy primary: a read of pages the endpoint does not
    hold waits while the page service is away and is answered once it is back (the page
    filesystem sends the batch again on a new connection), no I/O error."""
    wd = ["--workdir", str(cluster)]
    cli.main(["endpoint", "stop", "main", *wd])  # one primary per branch (it may not exist)
    pagestore_json(capsys, "endpoint", "start", "ps", *wd)
    pg = pg_of(cluster, "ps")
    pg.psql("CREATE TABLE away AS SELECT g, md5(g::text) AS v FROM generate_series(1, 20000) g")
    # PostgreSQL restarts on the same mount with the table's pages evicted from the local
    # cache and the kernel's: its next scan of the table reads the page service
    spec = endpoint.load_endpoint(LocalEnv.load(cluster), "ps").spec
    pg.stop("fast")
    time.sleep(1.5)  # the bridge's status file (the durable LSN) is rewritten every second
    assert pagefs_http(cluster, "ps", "POST", "/v1/evict")["evicted"] > 0
    pg = PostgresInstance(pg.datadir, port=spec.port, settings=endpoint._settings(spec))
    pg.start()
    pid = read_pid(LocalEnv.load(cluster).pageserver_dir / "pid")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until("the killed pageserver to be gone", lambda: not is_alive(pid), timeout=10)
    answer: list[str] = []
    reader = threading.Thread(target=lambda: answer.append(pg.psql("SELECT count(*), sum(g) FROM away", timeout=120)))
    reader.start()
    time.sleep(1)
    assert reader.is_alive()  # waiting for the page service, not failed
    assert cli.main(["start", *wd]) == 0  # the pageserver again (the others still run)
    reader.join(timeout=120)
    assert answer == ["20000|200010000"]
    assert pagefs_http(cluster, "ps", "GET", "/v1/status")["getpage_reconnects"] > 0
    pagestore(capsys, "endpoint", "stop", "ps", *wd)


def test_without_dev_fuse_a_lazy_start_names_it(cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if str(p) == "/dev/fuse" else real(p))
    with pytest.raises(endpoint.EndpointError, match=r"/dev/fuse.*--storage full"):
        endpoint.start_endpoint(LocalEnv.load(cluster), "nofuse", storage="lazy", log=lambda _m: None)
    with pytest.raises(endpoint.EndpointError, match=r"/dev/fuse.*--storage full"):  # lazy is the default
        endpoint.start_endpoint(LocalEnv.load(cluster), "nofuse", log=lambda _m: None)
