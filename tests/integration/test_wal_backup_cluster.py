"""A cluster with WAL backup (``pagestore init --remote-storage local``, and ``seaweedfs``: a real
S3 server as a node of the cluster): the safekeepers back
their closed segments up and trim them once the pageserver has them in remote storage too;
then the pageserver is recreated from scratch (kill -9, its data directory and its whole remote
tree ``tenants/`` gone), the timeline is imported again from the same stopped data directory,
and its WAL receiver catches up from the WAL backup (what no safekeeper holds any more) and
the safekeepers (the rest): every page at the latest LSN equals PostgreSQL's own (masked,
``bench.oracle``'s comparison), while the endpoint keeps committing."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from bench.oracle import Snapshot, catalog_rels, compare_snapshot
from compute.page_client import PageClient
from compute.postgres import PG_USER, PostgresInstance
from control_plane import cli, cluster
from control_plane.http_client import request_json
from control_plane.local_env import LocalEnv
from control_plane.process import read_pid, wait_until
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, parse_lsn
from remote_storage.wal_layout import wal_timeline_prefix
from tests.integration.cli_json import pagestore_json
from tests.integration.cluster_remote import delete_remote, quick_safekeepers, remote_keys

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TIMELINE = "5a" * 16


def sk_timelines(env: LocalEnv, tenant_id: str) -> list[dict[str, Any]]:
    out = []
    for sk_id in env.safekeeper_ids:
        out.append(request_json("GET", f"{env.safekeeper_http(sk_id)}/v1/tenant/{tenant_id}/timeline/{TIMELINE}"))
    return out


@pytest.mark.parametrize("kind", ["local", "seaweedfs"])
def test_pageserver_recreated_from_scratch_catches_up_from_the_wal_backup(
    pg_tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    workdir = pg_tmp_path / "cluster"
    wd = ["--workdir", str(workdir)]
    assert cli.main(["init", *wd, "--free-ports", "--no-sync", "--no-auth",
                     "--remote-storage", kind]) == 0
    try:
        env = LocalEnv.load(workdir)
        quick_safekeepers(env, kind)
        assert cli.main(["start", *wd]) == 0
        source = PostgresInstance.create(pg_tmp_path / "source")  # initdb: cleanly stopped
        # The tenant alone (no bootstrapped main timeline: the import is its only one).
        tenant_id = "7e" * 16
        request_json("POST", f"{env.pageserver_http}/v1/tenant", {"tenant_id": tenant_id})
        imported = pagestore_json(capsys, "timeline", "import", *wd, "--tenant-id", tenant_id,
                                  "--pgdata", str(source.datadir), "--branch-name", "imp",
                                  "--timeline-id", TIMELINE)
        start_lsn = parse_lsn(imported["last_record_lsn"])
        ep = pagestore_json(capsys, "endpoint", "start", "imp", *wd, "--branch-name", "imp",
                            "--tenant-id", tenant_id, "--storage", "full")
        pg = PostgresInstance(workdir / "endpoints/imp/pgdata", port=ep["port"], started=True)
        # WAL past the end of the segment the timeline starts in (that one gets trimmed).
        first_seg_end = (start_lsn // WAL_SEGMENT_SIZE + 1) * WAL_SEGMENT_SIZE
        pg.psql("CREATE TABLE big AS SELECT g, repeat(md5(g::text), 14) AS pad "
                "FROM generate_series(1, 40000) g")
        lsn = parse_lsn(pg.psql("SELECT pg_current_wal_flush_lsn()"))
        assert lsn > first_seg_end + WAL_SEGMENT_SIZE // 8
        cluster.wait_for_lsn(env, tenant_id, TIMELINE, lsn, timeout=300)
        # Flushed and uploaded: remote_consistent_lsn reaches the safekeepers, which trim.
        request_json("PUT", f"{env.pageserver_http}/v1/tenant/{tenant_id}/timeline/{TIMELINE}/checkpoint")
        try:
            wait_until("every safekeeper trimmed the WAL the timeline starts with", lambda: all(
                parse_lsn(t["wal_removed_below"]) >= first_seg_end for t in sk_timelines(env, tenant_id)
            ), timeout=120)
        except Exception:
            print(json.dumps(sk_timelines(env, tenant_id), indent=1))
            print(json.dumps(cluster.timeline_info(env, tenant_id, TIMELINE), indent=1))
            raise
        for t in sk_timelines(env, tenant_id):
            assert parse_lsn(t["backup_lsn"]) >= first_seg_end
        wal_prefix = wal_timeline_prefix(TenantId.parse(tenant_id), TimelineId.parse(TIMELINE))
        assert len(remote_keys(env, wal_prefix)) >= 1
        st = pagestore_json(capsys, "status", *wd)
        (tl,) = [t for t in st["timelines"] if t["timeline_id"] == TIMELINE]
        assert all(parse_lsn(v["backup_lsn"]) >= first_seg_end for v in tl["safekeepers"].values())

        # The pageserver is lost with everything it had: local disk and remote layers.
        ps_dir = env.pageserver_dir
        pid = read_pid(ps_dir / "pid")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until("pageserver gone", lambda: not Path(f"/proc/{pid}").exists()
                   or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), timeout=30)
        for entry in ps_dir.iterdir():
            if entry.name != "pageserver.toml":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        assert delete_remote(env, "tenants/") >= 2  # an index and its layers at least
        assert remote_keys(env, "tenants/") == []
        pg.psql("INSERT INTO big SELECT g, 'after the loss' FROM generate_series(1, 1000) g")
        assert cli.main(["start", *wd]) == 0
        tenants = request_json("GET", f"{env.pageserver_http}/v1/tenant")
        if tenant_id not in {t["id"] for t in tenants}:
            request_json("POST", f"{env.pageserver_http}/v1/tenant", {"tenant_id": tenant_id})
        again = request_json("POST", f"{env.pageserver_http}/v1/tenant/{tenant_id}/timeline/import",
                             {"source": str(source.datadir), "new_timeline_id": TIMELINE}, timeout=600)
        assert parse_lsn(again["last_record_lsn"]) == start_lsn
        pg.psql("INSERT INTO big SELECT g, 'while catching up' FROM generate_series(1, 1000) g")

        # every page at the latest LSN equals PostgreSQL's own
        pg.psql("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # to read its pg_class
        pg.psql("ALTER SYSTEM SET autovacuum = off")
        pg.psql("SELECT pg_reload_conf()")
        rels = catalog_rels(lambda db: f"host=127.0.0.1 port={ep['port']} user={PG_USER} dbname={db}")
        pg.psql("CHECKPOINT")
        lsn = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        cluster.wait_for_lsn(env, tenant_id, TIMELINE, lsn, timeout=300)
        snap = Snapshot("latest", lsn, workdir / "endpoints/imp/pgdata", rels, latest=True)

        async def compare() -> Any:
            async with await PageClient.connect("127.0.0.1", env.config.pageserver.pg,
                                                TenantId.parse(tenant_id), TimelineId.parse(TIMELINE),
                                                **env.page_client_auth(tenant_id)) as client:
                return await compare_snapshot(client, snap)

        res = trio.run(compare)
        assert res.mismatches == [], res.mismatches[:10]
        assert sum(res.pages.values()) > 1000
        # The first segment came from the backup (no safekeeper had it).
        info = cluster.timeline_info(env, tenant_id, TIMELINE)
        assert info["wal_receiver_remote_segments"] >= 1
    finally:
        cli.main(["stop", *wd, "--immediate"])
