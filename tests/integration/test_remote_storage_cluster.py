"""A cluster with a SeaweedFS node (``pagestore init --remote-storage seaweedfs``): pgbench on
an endpoint; kill -9 the pageserver; delete its whole data directory; start it again: the tenant
comes back from object storage, and every page at the latest LSN equals PostgreSQL's (masked,
``bench.oracle``'s comparison); the endpoint keeps committing throughout."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from bench.oracle import Snapshot, catalog_rels, compare_snapshot
from compute.page_client import PageClient
from compute.postgres import PG_USER, PostgresInstance
from control_plane import cli, cluster
from control_plane.local_env import LocalEnv
from control_plane.process import read_pid, wait_until
from protocol.ids import TenantId, TimelineId
from protocol.lsn import parse_lsn
from tests.integration.cli_json import pagestore_json
from tests.integration.cluster_remote import check_newest_index

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def cluster_init_args() -> list[str]:  # for cluster_dir (tests/integration/conftest.py)
    return ["--remote-storage", "seaweedfs"]


def test_pageserver_loses_its_disk_and_comes_back(cluster_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = ["--workdir", str(cluster_dir)]
    assert cli.main(["start", *wd]) == 0
    env = LocalEnv.load(cluster_dir)
    st = pagestore_json(capsys, "status", *wd)
    assert {n["name"]: n["http_ok"] for n in st["nodes"]}["seaweedfs"] is True
    tenant = pagestore_json(capsys, "tenant", "create", *wd)
    tenant_id, timeline_id = tenant["tenant_id"], str(tenant["timeline_id"])
    # full: its files, PostgreSQL's own, are the page comparison's oracle (a lazy endpoint's
    # are the pageserver's)
    ep = pagestore_json(capsys, "endpoint", "start", "main", *wd, "--storage", "full")
    main = PostgresInstance(cluster_dir / "endpoints/main/pgdata", port=ep["port"], started=True)
    main.pgbench("-i", "-s", "1", "-q")
    main.psql("CHECKPOINT")

    errors: list[BaseException] = []
    before = int(main.psql("SELECT count(*) FROM pgbench_history"))

    def load() -> None:
        try:
            main.pgbench("-n", "-c", "2", "-j", "2", "-T", "12")
        except BaseException as exc:
            errors.append(exc)

    bench = threading.Thread(target=load)
    bench.start()
    try:
        # the first layers are uploaded (creation waits for it), then the node dies with its disk
        wait_until("remote_consistent_lsn", lambda: parse_lsn(cluster.timeline_info(env, tenant_id, timeline_id)["remote_consistent_lsn"]) > 0, timeout=60)
        ps_dir = env.pageserver_dir
        pid = read_pid(ps_dir / "pid")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until("pageserver gone", lambda: not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), timeout=30)
        for entry in ps_dir.iterdir():
            if entry.name != "pageserver.toml":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        assert cli.main(["start", *wd]) == 0
        info = cluster.timeline_info(env, tenant_id, timeline_id)
        assert parse_lsn(info["last_record_lsn"]) > 0
    finally:
        bench.join()
    assert not errors, errors
    after = int(main.psql("SELECT count(*) FROM pgbench_history"))
    assert after > before, "the endpoint kept committing"

    # every page at the latest LSN equals PostgreSQL's own
    main.psql("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # to read its pg_class
    main.psql("ALTER SYSTEM SET autovacuum = off")
    main.psql("SELECT pg_reload_conf()")
    rels = catalog_rels(lambda db: f"host=127.0.0.1 port={ep['port']} user={PG_USER} dbname={db}")
    main.psql("CHECKPOINT")
    lsn = parse_lsn(main.psql("SELECT pg_current_wal_insert_lsn()"))
    cluster.wait_for_lsn(env, tenant_id, timeline_id, lsn, timeout=300)
    snap = Snapshot("latest", lsn, cluster_dir / "endpoints/main/pgdata", rels, latest=True)

    async def compare() -> Any:
        async with await PageClient.connect("127.0.0.1", env.config.pageserver.pg,
                                            TenantId.parse(tenant_id), TimelineId.parse(timeline_id),
                                            **env.page_client_auth(tenant_id)) as client:
            return await compare_snapshot(client, snap)

    res = trio.run(compare)
    assert res.mismatches == [], res.mismatches[:10]
    assert sum(res.pages.values()) > 100
    st = pagestore_json(capsys, "status", *wd)
    (tl,) = [t for t in st["timelines"] if t["timeline_id"] == timeline_id]
    assert parse_lsn(tl["remote_consistent_lsn"]) > 0
    # it came back from layers stored compressed (the node's default) and decompressed
    part = check_newest_index(env, tenant_id, timeline_id)
    assert "zstd" in {part.stored_layer(name).compression for name in part.layers}, part
