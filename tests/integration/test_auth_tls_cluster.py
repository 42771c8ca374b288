"""A cluster from ``pagestore init --tls`` (auth on, the default): every hop over verified TLS
with its token: the CLI to both HTTP APIs, the endpoint's basebackup, the walproposer bridge to
the safekeepers (commits need a quorum), the pageserver's WAL receivers from the safekeepers,
and pagestream reads of what was written."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from compute.page_client import PageClient
from compute.postgres import PostgresInstance
from control_plane import cli, cluster
from control_plane.local_env import LocalEnv
from protocol.ids import TenantId, TimelineId
from protocol.lsn import parse_lsn
from tests.integration.cli_json import pagestore_json

pytestmark = [pytest.mark.postgres]


def test_tls_cluster_end_to_end(pg_tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = pg_tmp_path / "cluster"
    init = pagestore_json(capsys, "init", "--workdir", str(wd), "--free-ports", "--no-sync",
                          "--safekeepers", "1", "--tls")
    assert isinstance(init, dict) and init["auth"] and init["tls"]
    try:
        assert cli.main(["start", "--workdir", str(wd)]) == 0
        tenant = pagestore_json(capsys, "tenant", "create", "--workdir", str(wd))
        assert isinstance(tenant, dict)
        ep = pagestore_json(capsys, "endpoint", "start", "main", "--workdir", str(wd))
        assert isinstance(ep, dict)
        pg = PostgresInstance(wd / "endpoints/main/pgdata", port=ep["port"], started=True)
        pg.psql("CREATE TABLE t AS SELECT g AS x FROM generate_series(1, 5000) g")
        rel = pg.psql("SELECT pg_relation_filenode('t'), (SELECT oid FROM pg_database WHERE datname = 'postgres')")
        lsn = parse_lsn(pg.psql("SELECT pg_current_wal_flush_lsn()"))
        env = LocalEnv.load(wd)
        t, tl = str(tenant["tenant_id"]), str(tenant["timeline_id"])
        cluster.wait_for_lsn(env, t, tl, lsn, timeout=60)  # HTTPS + token; ingest over TLS

        async def nblocks() -> int:
            from protocol.pagestream import RelTag

            filenode, db = (int(v) for v in rel.split("|"))
            async with await PageClient.connect(
                "127.0.0.1", env.config.pageserver.pg, TenantId.parse(t), TimelineId.parse(tl),
                **env.page_client_auth(t),
            ) as client:
                return await client.nblocks(RelTag(1663, db, filenode, 0), lsn)

        assert trio.run(nblocks) >= 1
        status = pagestore_json(capsys, "status", "--workdir", str(wd))
        assert isinstance(status, dict) and all(n["http_ok"] for n in status["nodes"])
    finally:
        cli.main(["stop", "--workdir", str(wd), "--immediate"])
