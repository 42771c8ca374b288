"""A primary endpoint whose compute died (kill -9 of PostgreSQL and its bridge mid-workload)
starts again with ``endpoint start``.

The bridge's last appends were flushed on the safekeepers, but the commit position covering
them rides on the next AppendRequest, which never came: the safekeepers hold WAL they will not
stream to the pageserver (only committed WAL goes there). ``endpoint start`` must commit it in
a new term (sync-safekeepers) and start the compute where it ends, with every commit a client
saw acknowledged, instead of waiting for the pageserver forever.

sync-safekeepers stops once a quorum has the new commit position: a third safekeeper can keep
the old one, and a WAL receiver streaming from it got keepalives and no WAL while
``endpoint start`` waited for the pageserver before starting the compute that would move it
(the stall 1 run in ~10 hit). The second test forces that case: the receiver's safekeeper is
frozen while sync-safekeepers runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from compute.postgres import PG_USER, PostgresInstance, pg_binary
from compute.walproposer.proposer import quorum_lsn, quorum_size
from control_plane import cli
from control_plane.http_client import get_json
from control_plane.local_env import LocalEnv
from control_plane.process import read_pid, wait_until
from protocol.lsn import Lsn, parse_lsn
from tests.integration.cli_json import pagestore_json

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@attrs.frozen
class KilledCompute:
    tenant: dict[str, str]
    env: LocalEnv
    flush: Lsn  # what a quorum of safekeepers had flushed when the compute died
    acknowledged: int  # pgbench_history rows whose commit a client saw


def kill_compute_mid_load(cluster_dir: Path, capsys: pytest.CaptureFixture[str]) -> KilledCompute:
    wd = ["--workdir", str(cluster_dir)]
    assert cli.main(["start", *wd]) == 0
    tenant = pagestore_json(capsys, "tenant", "create", *wd)
    ep = pagestore_json(capsys, "endpoint", "start", "main", *wd)
    pgdata = cluster_dir / "endpoints/main/pgdata"
    main = PostgresInstance(pgdata, port=ep["port"], started=True)
    main.pgbench("-i", "-s", "1", "-q")

    main.psql("CREATE TABLE big (id int, pad text)")
    acknowledged = int(main.psql("SELECT count(*) FROM pgbench_history"))
    main.psql("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) "
              "SELECT 1, 1, g, g, now() FROM generate_series(1, 77) g")
    acknowledged += 77
    # A bulk load streams WAL without pause: when the bridge dies, WAL it sent is flushed on
    # the safekeepers but the commit position covering it is still to be sent.
    start = parse_lsn(main.psql("SELECT pg_current_wal_flush_lsn()"))
    bulk = subprocess.Popen(
        ([] if os.geteuid() != 0 else ["runuser", "-u", PG_USER, "--"])
        + [pg_binary("psql"), "-X", "-h", "127.0.0.1", "-p", str(main.port), "-U", PG_USER, "-c",
           "INSERT INTO big SELECT g, repeat('x', 500) FROM generate_series(1, 3000000) g",
           "postgres"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_until("the bulk load streams WAL",
                   lambda: parse_lsn(main.psql("SELECT pg_current_wal_flush_lsn()")) > start + (16 << 20),
                   timeout=120)
        # The compute dies: its bridge (kill -9), then PostgreSQL (no shutdown checkpoint).
        # The bridge is frozen (SIGSTOP) first, so that the safekeepers' positions stay put
        # while they are read, and killed at a moment they hold uncommitted WAL (on a loaded
        # machine the bridge can be caught with everything committed: then it runs on a
        # little and is caught again).
        bridge_pid = read_pid(cluster_dir / "endpoints/main/bridge.pid")
        assert bridge_pid is not None
        env = LocalEnv.load(cluster_dir)
        for _attempt in range(100):
            os.kill(bridge_pid, signal.SIGSTOP)
            time.sleep(0.2)  # what the bridge sent before it froze arrives
            states = [
                get_json(f"{env.safekeeper_http(i)}/v1/tenant/{tenant['tenant_id']}/timeline/"
                         f"{tenant['timeline_id']}")
                for i in env.safekeeper_ids
            ]
            # WAL a quorum has flushed may have been acknowledged (the bridge reports the
            # quorum flush to PostgreSQL), so the new term must keep it. WAL beyond that, on a
            # minority only, may be truncated by an election whose voters lack it (Paxos: the
            # first quorum of votes decides), so it is not what the restart must start after.
            flush = quorum_lsn([parse_lsn(s["flush_lsn"]) for s in states], quorum_size(len(states)))
            commit = max(parse_lsn(s["commit_lsn"]) for s in states)
            if flush > commit:
                break
            os.kill(bridge_pid, signal.SIGCONT)
            time.sleep(0.05)
        else:
            os.kill(bridge_pid, signal.SIGCONT)
            pytest.fail("a quorum of safekeepers never held uncommitted WAL during the bulk load")
        os.kill(bridge_pid, signal.SIGKILL)
        main.stop("immediate")
    finally:
        bulk.kill()
        bulk.wait()

    return KilledCompute(tenant, env, flush, acknowledged)


def check_restarted(cluster_dir: Path, killed: KilledCompute, ep2: dict[str, Any]) -> None:
    pgdata = cluster_dir / "endpoints/main/pgdata"
    assert parse_lsn(ep2["basebackup_lsn"]) >= killed.flush
    again = PostgresInstance(pgdata, port=ep2["port"], started=True)
    acknowledged = killed.acknowledged
    assert int(again.psql("SELECT count(*) FROM pgbench_history")) == acknowledged
    assert again.psql("SELECT count(*) FROM big") == "0"  # the load never committed
    assert int(again.psql("SELECT count(*) FROM pgbench_accounts")) == 100_000
    again.psql("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, 1, 1, now())")


def test_primary_restarts_after_its_compute_was_killed(
    cluster_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = kill_compute_mid_load(cluster_dir, capsys)
    ep2 = pagestore_json(capsys, "endpoint", "start", "main", "--workdir", str(cluster_dir))
    check_restarted(cluster_dir, killed, ep2)


def test_restart_while_the_pageserver_streams_from_a_safekeeper_sync_left_behind(
    cluster_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The safekeeper the pageserver streams from is frozen (SIGSTOP) while ``endpoint start``
    runs sync-safekeepers, which commits on the other two and exits; thawed, it goes on
    sending keepalives with its old commit position. The pageserver must get the WAL from
    the others, or ``endpoint start`` waits for it in vain."""
    killed = kill_compute_mid_load(cluster_dir, capsys)
    env, tenant = killed.env, killed.tenant
    info = get_json(f"{env.pageserver_http}/v1/tenant/{tenant['tenant_id']}/timeline/"
                    f"{tenant['timeline_id']}")
    streaming_from = info["wal_receiver_safekeeper"]
    assert streaming_from in env.safekeeper_pg_addrs, info
    sk_id = env.safekeeper_ids[env.safekeeper_pg_addrs.index(streaming_from)]
    sk_pid = read_pid(env.safekeeper_dir(sk_id) / "pid")
    assert sk_pid is not None
    sync_log = cluster_dir / "endpoints/main/sync-safekeepers.log"
    rc: list[int] = []
    capsys.readouterr()
    # endpoint start reads the safekeepers' states (the frozen one times out after 5 s: two of
    # three answered is enough), syncs, then waits for the pageserver.
    starter = threading.Thread(
        target=lambda: rc.append(cli.main(["endpoint", "start", "main", "--workdir",
                                           str(cluster_dir), "--json"])),
        daemon=True,
    )
    os.kill(sk_pid, signal.SIGSTOP)
    try:
        starter.start()
        wait_until("sync-safekeepers committed the tail",
                   lambda: sync_log.exists() and "safekeepers synced" in sync_log.read_text(),
                   timeout=60)
    finally:
        os.kill(sk_pid, signal.SIGCONT)
    starter.join()
    captured = capsys.readouterr()
    assert rc == [0], captured.err
    check_restarted(cluster_dir, killed, json.loads(captured.out))
