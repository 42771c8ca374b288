"""The demo's flow through the CLI, with real nodes, a real PostgreSQL 15 and pgbench.

init (free ports) -> start -> tenant create -> endpoint main -> pgbench -i -s 1 -> a quiet
change noted at LSN L0 -> pgbench for ~5 s, with the data and LSN L1 noted half way under a lock
-> timeline branch at L1 -> endpoint on the branch -> read-only endpoint at L0 -> status -> stop.

Checked:
- the branch endpoint's ``sum(abalance)`` and ``count(*)`` of ``pgbench_history`` equal what
  main returned at L1 (and main has moved on, so the check can fail);
- a basebackup at the past LSN L0 boots a read-only endpoint with exactly the data of then;
- the branch endpoint is a primary of its own: what it writes does not show on main;
- ``status --json`` reports each timeline's pageserver and safekeeper LSNs;
- ``timeline import --pgdata`` turns a stopped PostgreSQL's data directory into a branch that an
  endpoint boots from and writes to;
- ``stop`` ends every process it started.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from compute.postgres import PG_USER, PostgresInstance, pg_binary
from control_plane import cli
from control_plane.local_env import LocalEnv
from control_plane.process import is_alive, read_pid, wait_until
from protocol.lsn import parse_lsn
from tests.integration.cli_json import pagestore_json

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def pagestore(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    rc = cli.main(list(args))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out


def counts(pg: PostgresInstance) -> tuple[int, int]:
    total, n = pg.psql(
        "SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT count(*) FROM pgbench_history)"
    ).split("|")
    return int(total), int(n)


def locked_snapshot(pg: PostgresInstance) -> tuple[int, int, str]:
    """Data and LSN together: writers of both tables wait while we read (readers do not)."""
    out = pg.psql(
        "BEGIN; LOCK TABLE pgbench_accounts, pgbench_history IN EXCLUSIVE MODE; "
        "SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT count(*) FROM pgbench_history), "
        "pg_current_wal_insert_lsn(); COMMIT;"
    )
    total, n, lsn = out.splitlines()[-1].split("|")
    return int(total), int(n), lsn


def test_branch_past_lsn_and_import(cluster_dir: Path, pg_tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    wd = ["--workdir", str(cluster_dir)]
    pagestore(capsys, "start", *wd)
    tenant = pagestore_json(capsys, "tenant", "create", *wd)
    assert tenant["branch"] == "main"

    main_ep = pagestore_json(capsys, "endpoint", "start", "main", *wd)
    assert main_ep["running"] and main_ep["bridge_pid"] and not main_ep["read_only"]
    main = PostgresInstance(Path(cluster_dir / "endpoints/main/pgdata"), port=main_ep["port"], started=True)
    assert main.psql("SHOW synchronous_standby_names") == "walproposer"
    main.pgbench("-i", "-s", "1", "-q")

    # L0: a quiet change, then the LSN: exactly this data is visible at L0.
    main.psql("UPDATE pgbench_accounts SET abalance = aid % 97 WHERE aid % 10 = 0")
    main.psql("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) "
              "SELECT 1, 1, g, g, now() FROM generate_series(1, 37) g")
    past_sum, past_count = counts(main)
    past_lsn = main.psql("SELECT pg_current_wal_insert_lsn()")
    assert (past_sum, past_count) != (0, 0)

    bench = subprocess.Popen(
        ([] if os.geteuid() != 0 else ["runuser", "-u", PG_USER, "--"])
        + [pg_binary("pgbench"), "-h", "127.0.0.1", "-p", str(main.port), "-U", PG_USER, "-n",
           "-c", "2", "-T", "8", "postgres"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        # Branch mid-run: once pgbench has committed (a fixed sleep may end before a slow
        # machine has even connected), with seconds of its run still to go after the branch.
        wait_until("pgbench commits", lambda: bench.poll() is not None or counts(main)[1] > past_count,
                   timeout=60)
        time.sleep(1.0)
        half_sum, half_count, half_lsn = locked_snapshot(main)
        branch = pagestore_json(capsys, "timeline", "branch", *wd, "--branch-name", "half",
                                "--ancestor-lsn", half_lsn)
    finally:
        out, _ = bench.communicate(timeout=60)
    assert bench.returncode == 0, out.decode(errors="replace")
    assert branch["ancestor_lsn"] == half_lsn
    end_sum, end_count = counts(main)
    assert (end_sum, end_count) != (half_sum, half_count), "main did not move on after the branch point"
    assert half_count > past_count

    # The branch shows main as of L1, exactly.
    half_ep = pagestore_json(capsys, "endpoint", "start", "half", *wd, "--branch-name", "half")
    assert half_ep["basebackup_lsn"] == half_lsn and half_ep["bridge_pid"]
    half = PostgresInstance(Path(cluster_dir / "endpoints/half/pgdata"), port=half_ep["port"], started=True)
    assert counts(half) == (half_sum, half_count)
    # ... and it is a primary of its own.
    half.psql("UPDATE pgbench_accounts SET abalance = abalance + 1000 WHERE aid = 1")
    assert counts(half) == (half_sum + 1000, half_count)
    assert counts(main) == (end_sum, end_count)

    # A basebackup at the past LSN L0 boots a read-only endpoint with the data of then.
    past_ep = pagestore_json(capsys, "endpoint", "start", "past", *wd, "--lsn", past_lsn)
    assert past_ep["read_only"] and past_ep["bridge_pid"] is None
    past = PostgresInstance(Path(cluster_dir / "endpoints/past/pgdata"), port=past_ep["port"], started=True)
    assert counts(past) == (past_sum, past_count)
    assert past.psql("SHOW default_transaction_read_only") == "on"

    # Status: every timeline with the pageserver's and each safekeeper's LSNs.
    st = pagestore_json(capsys, "status", *wd)
    assert all(n["http_ok"] for n in st["nodes"])
    by_branch = {t["branch"]: t for t in st["timelines"]}
    assert set(by_branch) == {"main", "half"}
    assert by_branch["half"]["ancestor_lsn"] == half_lsn
    for t in by_branch.values():
        assert set(t["safekeepers"]) == {"safekeeper_1", "safekeeper_2", "safekeeper_3"}
        assert parse_lsn(t["last_record_lsn"]) >= parse_lsn(t["disk_consistent_lsn"])
    # Synchronous commit: main's flushed WAL is committed on the safekeepers.
    commits = [parse_lsn(v["commit_lsn"]) for v in by_branch["main"]["safekeepers"].values()]
    assert sorted(commits)[1] >= parse_lsn(half_lsn)
    # (read after status: main's autovacuum may write WAL meanwhile)
    assert max(commits) <= parse_lsn(main.psql("SELECT pg_current_wal_flush_lsn()"))
    assert {e["name"] for e in st["endpoints"]} == {"main", "half", "past"}

    listed = pagestore_json(capsys, "timeline", "list", *wd)
    assert {t["branch"] for t in listed} == {"main", "half"}

    # timeline import --pgdata: a stopped PostgreSQL's data becomes a branch an endpoint runs on.
    source = PostgresInstance.create(pg_tmp_path / "source")
    source.start()
    source.psql("CREATE TABLE imported AS SELECT g, md5(g::text) AS m FROM generate_series(1, 3000) g")
    expected = source.psql("SELECT count(*), sum(g), max(m) FROM imported")
    source.stop()
    imported = pagestore_json(capsys, "timeline", "import", *wd, "--pgdata", str(source.datadir),
                              "--branch-name", "imported")
    imp_ep = pagestore_json(capsys, "endpoint", "start", "imp", *wd, "--branch-name", "imported")
    assert imp_ep["basebackup_lsn"] == imported["last_record_lsn"]
    imp = PostgresInstance(cluster_dir / "endpoints/imp/pgdata", port=imp_ep["port"], started=True)
    assert imp.psql("SELECT count(*), sum(g), max(m) FROM imported") == expected
    imp.psql("INSERT INTO imported VALUES (0, 'new')")
    assert imp.psql("SELECT count(*) FROM imported") == "3001"

    # Stop ends every process the cluster started.
    env = LocalEnv.load(cluster_dir)
    pids = [read_pid(d / "pid") for _, d in env.node_dirs()]
    pids += [read_pid(cluster_dir / f"endpoints/{n}/bridge.pid") for n in ("main", "half", "imp")]
    pagestore(capsys, "stop", *wd)
    assert all(p is not None and not is_alive(p) for p in pids)
    assert not list(cluster_dir.glob("endpoints/*/pgdata/postmaster.pid"))

