"""A cluster of two pageservers on SeaweedFS (``pagestore init --pageservers 2 --remote-storage
seaweedfs``): a tenant migrated under load (pgbench, and one client that records every
acknowledged commit) from pageserver_1 to pageserver_2 with ``pagestore tenant migrate``; then,
still under load, pageserver_2 is killed (-9), its whole data directory deleted, and started
again: the controller re-attaches the tenant there in a new generation, from object storage.

- no acknowledged commit is lost, the endpoint keeps committing throughout;
- the controller hands out generation 2 on pageserver_2 (3 after its restart); pageserver_1
  lets go; attaching the tenant twice is refused;
- the endpoints follow: a lazy read-only endpoint's page filesystem reads from pageserver_2
  (its cache evicted, every read after the migration goes there), and the walproposer
  bridge sees pageserver feedback for WAL written after pageserver_1 detached;
- ``status`` shows the tenant on pageserver_2 with a ``remote_consistent_lsn``;
- every page at the latest LSN on pageserver_2 equals PostgreSQL's (masked, ``bench.oracle``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

from bench.oracle import Snapshot, catalog_rels, compare_snapshot
from compute.page_client import PageClient
from compute.postgres import PG_USER, PostgresInstance
from control_plane import cli, cluster, process
from control_plane.http_client import ApiError, get_json, post_json
from control_plane.local_env import LocalEnv
from control_plane.process import read_pid, wait_until
from protocol.ids import TenantId, TimelineId
from protocol.lsn import parse_lsn
from tests.integration.cli_json import pagestore_json


def _gone(pid: int) -> bool:
    return not process.is_alive(pid)


pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def cluster_init_args() -> list[str]:  # for cluster_dir (tests/integration/conftest.py)
    return ["--pageservers", "2", "--remote-storage", "seaweedfs"]


def test_tenant_migrates_under_load(cluster_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = ["--workdir", str(cluster_dir)]
    assert cli.main(["start", *wd]) == 0
    env = LocalEnv.load(cluster_dir)
    st = pagestore_json(capsys, "status", *wd)
    assert {n["name"] for n in st["nodes"] if n["http_ok"]} == {
        "pageserver_1", "pageserver_2", "safekeeper_1", "safekeeper_2", "safekeeper_3",
        "storage_controller", "seaweedfs"}
    # Auth is on, on the storage controller too: without a token it moves nothing.
    assert env.storage_controller_url is not None
    anon = urllib.request.Request(f"{env.storage_controller_url}/control/v1/tenant/{'ab' * 16}/attach",
                                  b'{"node_id": 2}', {"content-type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as anon_refused:
        urllib.request.urlopen(anon, timeout=30)
    assert anon_refused.value.code == 401
    tenant = pagestore_json(capsys, "tenant", "create", *wd)
    tenant_id, timeline_id = tenant["tenant_id"], str(tenant["timeline_id"])
    assert tenant["pageserver"] == "pageserver_1"
    # full: its files, PostgreSQL's own, are the page comparison's oracle below (a lazy
    # endpoint's are the pageserver's)
    ep = pagestore_json(capsys, "endpoint", "start", "main", *wd, "--storage", "full")
    assert ep["pageserver"] == "pageserver_1"
    main = PostgresInstance(cluster_dir / "endpoints/main/pgdata", port=ep["port"], started=True)
    main.pgbench("-i", "-s", "1", "-q")
    main.psql("CREATE TABLE acks (id int PRIMARY KEY)")
    main.psql("CHECKPOINT")
    ro_lsn = main.psql("SELECT pg_current_wal_insert_lsn()")
    ro = pagestore_json(capsys, "endpoint", "start", "ro", "--lsn", ro_lsn, "--storage", "lazy", *wd)
    ro_pg = PostgresInstance(cluster_dir / "endpoints/ro/pgdata", port=ro["port"], started=True)
    # (pgbench_accounts is not read there before the migration: neither PostgreSQL's buffers
    # nor the page filesystem's cache hold it, its pages must come from pageserver_2)

    errors: list[BaseException] = []
    acked: list[int] = []
    stop = threading.Event()
    dsn = f"host=127.0.0.1 port={ep['port']} user={PG_USER} dbname=postgres"

    def bench() -> None:
        try:
            while not stop.is_set():
                main.pgbench("-n", "-c", "2", "-j", "2", "-T", "3")
        except BaseException as exc:
            errors.append(exc)

    def acker() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                i = 0
                while not stop.is_set():
                    i += 1
                    conn.execute("INSERT INTO acks VALUES (%s)", (i,))
                    acked.append(i)  # only once the commit is acknowledged
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=bench), threading.Thread(target=acker)]
    for t in threads:
        t.start()
    try:
        wait_until("commits before the migration", lambda: len(acked) > 20 and not errors, timeout=60)
        before = len(acked)
        moved = pagestore_json(capsys, "tenant", "migrate", tenant_id, "--to", "pageserver_2", *wd)
        assert (moved["from"], moved["to"], moved["generation"], moved["detached"]) == (
            "pageserver_1", "pageserver_2", 2, True)
        assert sorted(moved["endpoints"]) == ["main", "ro"]
        with pytest.raises(ApiError) as refused:
            post_json(f"{env.pageserver_http_of(2)}/v1/tenant/{tenant_id}/attach", {"generation": 2})
        assert refused.value.status == 409
        # the endpoint kept committing through the migration (and goes on)
        wait_until("commits after the migration", lambda: len(acked) > before + 20 or bool(errors), timeout=60)
        assert not errors, errors

        assert get_json(f"{env.pageserver_http_of(1)}/v1/tenant") == []
        assert not (env.pageserver_dir_of(1) / "tenants" / tenant_id).exists()

        # pageserver_2 dies with its disk, pageserver_1 restarts; started again, pageserver_2
        # gets the tenant back from S3, and pageserver_1 nothing
        ps_dir = env.pageserver_dir_of(2)
        for ps, sig in ((1, signal.SIGTERM), (2, signal.SIGKILL)):
            pid = read_pid(env.pageserver_dir_of(ps) / "pid")
            assert pid is not None
            os.kill(pid, sig)
            # gone as the control plane sees it: no thread left holding its ports
            wait_until(f"pageserver_{ps} gone", functools.partial(_gone, pid), timeout=30)
        for entry in ps_dir.iterdir():
            if entry.name != "pageserver.toml":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        before = len(acked)
        assert cli.main(["start", *wd]) == 0
        assert len(acked) > before, "the endpoint kept committing while pageserver_2 was gone"
        info = cluster.timeline_info(env, tenant_id, timeline_id)
        assert parse_lsn(info["last_record_lsn"]) > 0
        wait_until("commits after the restart", lambda: len(acked) > before + 20 or bool(errors), timeout=60)
        assert not errors, errors
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    rows = {int(x) for x in main.psql("SELECT id FROM acks").split()}
    assert set(acked) <= rows, f"acknowledged commits lost: {sorted(set(acked) - rows)[:10]}"

    # pageserver_1 holds nothing; status shows where the tenant is
    assert get_json(f"{env.pageserver_http_of(1)}/v1/tenant") == []
    st = pagestore_json(capsys, "status", *wd)
    assert st["tenants"] == [{"tenant_id": tenant_id, "pageserver": "pageserver_2", "generation": 3}]
    (tl,) = [t for t in st["timelines"] if t["timeline_id"] == timeline_id]
    assert tl["pageserver"] == "pageserver_2"
    assert {e["name"]: e["pageserver"] for e in st["endpoints"]} == {"main": "pageserver_2", "ro": "pageserver_2"}

    # the bridge sees feedback for WAL written after pageserver_1 detached: pageserver_2's
    main.psql("INSERT INTO acks VALUES (-1)")
    after = parse_lsn(main.psql("SELECT pg_current_wal_insert_lsn()"))
    bridge_status = cluster_dir / "endpoints/main/bridge-status.json"

    def feedback_lsn() -> int:
        fb = json.loads(bridge_status.read_text()).get("pageserver_feedback")
        return 0 if fb is None else parse_lsn(fb["last_received_lsn"])

    wait_until("pageserver feedback from pageserver_2", lambda: feedback_lsn() >= after, timeout=60)

    # the lazy endpoint reads from pageserver_2 (its cache dropped too): the table as of ro_lsn,
    # right after pgbench -i
    ro_status = json.loads((cluster_dir / "endpoints/ro/pagefs-status.json").read_text())
    assert ro_status["pageserver"] == f"127.0.0.1:{env.pageserver_ports(2).pg}"
    pages_before = ro_status["getpage_pages"]
    post_json(f"http://127.0.0.1:{ro_status['http_port']}/v1/evict", {})
    assert ro_pg.psql("SELECT count(*), sum(abalance) FROM pgbench_accounts") == "100000|0"
    assert ro_pg.psql("SELECT count(*) FROM acks") == "0"
    wait_until("pagefs status written", lambda: json.loads(
        (cluster_dir / "endpoints/ro/pagefs-status.json").read_text())["getpage_pages"] > pages_before, timeout=10)
    assert json.loads((cluster_dir / "endpoints/ro/pagefs-status.json").read_text())["getpage_errors"] == 0

    # every page at the latest LSN on pageserver_2 equals PostgreSQL's own
    main.psql("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # to read its pg_class
    main.psql("ALTER SYSTEM SET autovacuum = off")
    main.psql("SELECT pg_reload_conf()")
    rels = catalog_rels(lambda db: f"host=127.0.0.1 port={ep['port']} user={PG_USER} dbname={db}")
    main.psql("CHECKPOINT")
    lsn = parse_lsn(main.psql("SELECT pg_current_wal_insert_lsn()"))
    cluster.wait_for_lsn(env, tenant_id, timeline_id, lsn, timeout=300)
    snap = Snapshot("latest", lsn, cluster_dir / "endpoints/main/pgdata", rels, latest=True)

    async def compare() -> Any:
        async with await PageClient.connect("127.0.0.1", env.pageserver_ports(2).pg,
                                            TenantId.parse(tenant_id), TimelineId.parse(timeline_id),
                                            **env.page_client_auth(tenant_id)) as client:
            return await compare_snapshot(client, snap)

    res = trio.run(compare)
    assert res.mismatches == [], res.mismatches[:10]
    assert sum(res.pages.values()) > 100
    st = pagestore_json(capsys, "status", *wd)
    (tl,) = [t for t in st["timelines"] if t["timeline_id"] == timeline_id]
    assert parse_lsn(tl["remote_consistent_lsn"]) > 0
