"""Deleting a timeline and a tenant in a cluster with remote storage (``pagestore timeline
delete``, ``pagestore tenant delete``): the pageserver's layers and indexes
(``tenants/<tenant>/timelines/<timeline>/``) and the safekeepers' WAL backup
(``wal/<tenant>/<timeline>/``) go with it, on every node; what a live timeline (the deleted
one's ancestor) and another tenant use stays, object for object, and the live timeline's
endpoint keeps committing and backing its WAL up. Refused while an endpoint runs on it, and on
the pageserver while it has branches."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from compute.postgres import PostgresInstance
from control_plane import cli, cluster
from control_plane.http_client import ApiError, request_json
from control_plane.local_env import LocalEnv
from control_plane.process import wait_until
from protocol.ids import TenantId, TimelineId
from protocol.lsn import parse_lsn
from remote_storage.wal_layout import wal_tenant_prefix, wal_timeline_prefix
from tests.integration.cli_json import pagestore_json
from tests.integration.cluster_remote import check_newest_index, quick_safekeepers, remote_keys

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _layers_prefix(tenant: str, timeline: str) -> str:
    return f"tenants/{tenant}/timelines/{timeline}/"


def _wal_prefix(tenant: str, timeline: str) -> str:
    return wal_timeline_prefix(TenantId.parse(tenant), TimelineId.parse(timeline))


def _fill_a_segment(pg: PostgresInstance, what: str) -> int:
    """Some rows, then a closed WAL segment (the safekeepers back up closed segments only);
    the flush LSN after it."""
    pg.psql(f"CREATE TABLE IF NOT EXISTS t (g int, what text); INSERT INTO t SELECT g, '{what}' "
            "FROM generate_series(1, 500) g")
    pg.psql("SELECT pg_switch_wal()")
    pg.psql(f"INSERT INTO t VALUES (0, '{what} after the switch')")
    return parse_lsn(pg.psql("SELECT pg_current_wal_flush_lsn()"))


def _backed_up(env: LocalEnv, tenant: str, timeline: str) -> bool:
    return bool(remote_keys(env, _wal_prefix(tenant, timeline)))


def _status(env: LocalEnv, sk_id: int, tenant: str, timeline: str) -> int:
    try:
        request_json("GET", f"{env.safekeeper_http(sk_id)}/v1/tenant/{tenant}/timeline/{timeline}")
    except ApiError as exc:
        return exc.status
    return 200


@pytest.fixture
def cluster_init_args() -> list[str]:  # for cluster_dir (tests/integration/conftest.py)
    return ["--no-auth", "--remote-storage", "local"]


def test_timeline_and_tenant_delete_take_their_remote_objects(
    cluster_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = cluster_dir
    wd = ["--workdir", str(workdir)]
    env = LocalEnv.load(workdir)
    quick_safekeepers(env, "local")
    assert cli.main(["start", *wd]) == 0
    created = pagestore_json(capsys, "tenant", "create", *wd)
    tenant, main_tl = created["tenant_id"], str(created["timeline_id"])
    second = pagestore_json(capsys, "tenant", "create", *wd)  # must not be touched
    other, other_tl = second["tenant_id"], second["timeline_id"]
    ep_main = pagestore_json(capsys, "endpoint", "start", "m", *wd, "--storage", "full")
    pg_main = PostgresInstance(workdir / "endpoints/m/pgdata", port=ep_main["port"], started=True)
    lsns = {main_tl: _fill_a_segment(pg_main, "main")}
    doomed_tl = str(pagestore_json(capsys, "timeline", "branch", *wd, "--branch-name", "doomed")["timeline_id"])
    ep_d = pagestore_json(capsys, "endpoint", "start", "d", *wd, "--branch-name", "doomed", "--storage", "full")
    pg_d = PostgresInstance(workdir / "endpoints/d/pgdata", port=ep_d["port"], started=True)
    lsns[doomed_tl] = _fill_a_segment(pg_d, "doomed")
    for tl in (main_tl, doomed_tl):
        cluster.wait_for_lsn(env, tenant, tl, lsns[tl], timeout=60)  # then the checkpoint has layers
        request_json("PUT", f"{env.pageserver_http}/v1/tenant/{tenant}/timeline/{tl}/checkpoint")
        wait_until(f"WAL of {tl} backed up", functools.partial(_backed_up, env, tenant, tl), timeout=60)
        assert remote_keys(env, _layers_prefix(tenant, tl))
    # Everything each must keep, as it is now.
    kept = {p: remote_keys(env, p) for p in (_wal_prefix(tenant, main_tl), f"tenants/{other}/")}

    # Refused: an endpoint runs on it; on the pageserver, a timeline with a branch.
    capsys.readouterr()
    assert cli.main(["timeline", "delete", *wd, "--branch-name", "doomed"]) == 1
    assert "endpoint d runs on" in capsys.readouterr().err
    with pytest.raises(ApiError) as refused:
        request_json("DELETE", f"{env.pageserver_http}/v1/tenant/{tenant}/timeline/{main_tl}")
    assert refused.value.status == 412 and doomed_tl in refused.value.msg

    assert cli.main(["endpoint", "stop", *wd, "d"]) == 0
    deleted = pagestore_json(capsys, "timeline", "delete", *wd, "--branch-name", "doomed")
    assert deleted["timeline_id"] == doomed_tl and deleted["branches"] == ["doomed"]
    # Its stopped endpoint stays listed until `endpoint remove`: then its directory goes.
    assert deleted["stopped_endpoints_left"] == ["d"]
    removed = pagestore_json(capsys, "endpoint", "remove", *wd, "d")
    assert removed["timeline_id"] == doomed_tl and not (workdir / "endpoints/d").exists()
    assert [e["name"] for e in pagestore_json(capsys, "endpoint", "list", *wd)] == ["m"]
    assert cli.main(["endpoint", "remove", *wd, "d"]) == 1
    assert "no endpoint 'd'" in capsys.readouterr().err
    # Refused while it runs: the directory stays whole.
    assert cli.main(["endpoint", "remove", *wd, "m"]) == 1
    assert "endpoint 'm' is running (PostgreSQL (pid" in capsys.readouterr().err
    assert (workdir / "endpoints/m/endpoint.json").exists() and pg_main.psql("SELECT 1") == "1"
    assert deleted["pageserver"]["remote_objects_deleted"] >= 2  # an index and a layer at least
    sk_answers: list[Any] = list(deleted["safekeepers"].values())
    assert all(a is not None and a["dir_existed"] for a in sk_answers), sk_answers
    assert sum(a["remote_objects_deleted"] for a in sk_answers) >= 1
    assert remote_keys(env, _wal_prefix(tenant, doomed_tl)) == []
    assert remote_keys(env, _layers_prefix(tenant, doomed_tl)) == []
    for sk_id in env.safekeeper_ids:
        assert _status(env, sk_id, tenant, doomed_tl) == 404
        assert not (env.safekeeper_dir(sk_id) / "data" / tenant / doomed_tl).exists()
    with pytest.raises(ApiError) as gone:
        request_json("GET", f"{env.pageserver_http}/v1/tenant/{tenant}/timeline/{doomed_tl}")
    assert gone.value.status == 404
    assert not (env.pageserver_dir / "tenants" / tenant / "timelines" / doomed_tl).exists()
    assert [t["branch"] for t in pagestore_json(capsys, "timeline", "list", *wd)] == ["main"]
    # Nothing a live timeline or another tenant uses went.
    for prefix, keys in kept.items():
        assert set(keys) <= set(remote_keys(env, prefix)), prefix
    check_newest_index(env, tenant, main_tl)  # (its layers may change: compaction runs)
    check_newest_index(env, other, str(other_tl))
    # The live one still commits, is ingested, and backs its WAL up.
    before = len(remote_keys(env, _wal_prefix(tenant, main_tl)))
    lsn = _fill_a_segment(pg_main, "after the deletion")
    cluster.wait_for_lsn(env, tenant, main_tl, lsn, timeout=60)
    wait_until("main's WAL still backed up",
               lambda: len(remote_keys(env, _wal_prefix(tenant, main_tl))) > before, timeout=60)
    assert pg_main.psql("SELECT count(*) FROM t") == "1002"
    # Deleting it again: nothing is left anywhere.
    capsys.readouterr()
    assert cli.main(["timeline", "delete", *wd, "--timeline-id", doomed_tl]) == 1
    assert "not found" in capsys.readouterr().err

    assert cli.main(["endpoint", "stop", *wd, "m"]) == 0
    out = pagestore_json(capsys, "tenant", "delete", *wd, tenant)
    assert out["stopped_endpoints_left"] == ["m"]
    assert cli.main(["endpoint", "remove", *wd, "m"]) == 0
    assert not (workdir / "endpoints/m").exists()
    assert pagestore_json(capsys, "endpoint", "list", *wd) == []
    assert out["pageserver"]["remote_objects_deleted"] >= 2
    assert remote_keys(env, wal_tenant_prefix(TenantId.parse(tenant))) == []
    assert remote_keys(env, f"tenants/{tenant}/") == []
    assert remote_keys(env, f"tenants/{other}/") == kept[f"tenants/{other}/"]
    check_newest_index(env, other, str(other_tl))
    with pytest.raises(ApiError) as no_tenant:
        request_json("GET", f"{env.pageserver_http}/v1/tenant/{tenant}")
    assert no_tenant.value.status == 404
    for sk_id in env.safekeeper_ids:
        assert not (env.safekeeper_dir(sk_id) / "data" / tenant).exists()
