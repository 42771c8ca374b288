"""The pageserver's HTTP management API against a real node process (one per module)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pageserver.storage.key import is_rel_block_key, key_parse_hex
from protocol import _native
from protocol.lsn import parse_lsn
from tests.pageserver.node_helpers import NodeProcess, running_node
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres  # timeline bootstrap runs initdb


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    with pg_tmpdir("pagestore-http-") as base, running_node(base / "ps") as proc:
        yield proc


@pytest.fixture(scope="module")
def bootstrapped(node: NodeProcess) -> tuple[str, str]:
    status, body = node.request("POST", "/v1/tenant", {})
    assert status == 201, body
    tenant = body["tenant_id"]
    status, info = node.request("POST", f"/v1/tenant/{tenant}/timeline", {"pg_version": 15})
    assert status == 201, info
    return tenant, info["timeline_id"]


def test_status_and_metrics(node: NodeProcess) -> None:
    status, body = node.request("GET", "/v1/status")
    assert status == 200 and body["id"] == 1
    assert body["impl"] == _native.IMPL and body["crc32c"] == _native.describe()["crc32c"]
    status, text = node.request("GET", "/metrics")
    assert status == 200
    assert "pageserver_materialized_cache_hits_total" in text  # storage engine (process registry)
    assert "pageserver_page_service_getpage_execution_seconds" in text  # page service (node registry)


def test_create_tenant_with_id_and_duplicates(node: NodeProcess) -> None:
    tid = "0123456789abcdef0123456789abcdef"
    assert node.request("POST", "/v1/tenant", {"tenant_id": tid}) == (201, {"tenant_id": tid})
    status, body = node.request("POST", "/v1/tenant", {"new_tenant_id": tid})
    assert status == 409 and tid in body["msg"]
    status, tenants = node.request("GET", "/v1/tenant")
    assert status == 200 and tid in [t["id"] for t in tenants]
    assert node.request("GET", f"/v1/tenant/{tid}") == (200, {"id": tid, "state": "Active", "timelines": []})


@pytest.mark.parametrize(
    "method, path, body, code",
    [
        ("GET", "/v1/tenant/nothex", None, 400),
        ("GET", "/v1/tenant/" + "ab" * 16, None, 404),
        ("GET", "/v1/tenant/" + "ab" * 16 + "/timeline", None, 404),
        ("POST", "/v1/tenant", {"tenant_id": "xyz"}, 400),
        ("POST", "/v1/tenant", {"bogus": 1}, 400),
        ("POST", "/v1/tenant", [1, 2], 400),
        ("GET", "/v1/nothing", None, 404),
        ("DELETE", "/v1/tenant", None, 405),
    ],
)
def test_errors_are_json_with_status(node: NodeProcess, method: str, path: str, body: object, code: int) -> None:
    status, answer = node.request(method, path, body)
    assert status == code, answer
    assert isinstance(answer, dict) and isinstance(answer["msg"], str) and answer["msg"]


def test_malformed_json_is_400(node: NodeProcess) -> None:
    status, answer = node.request("POST", "/v1/tenant", raw=b"{not json")
    assert status == 400 and "JSON" in answer["msg"]


def test_timelines_bootstrap_get_list_branch(node: NodeProcess, bootstrapped: tuple[str, str]) -> None:
    tenant, timeline = bootstrapped
    status, info = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
    assert status == 200
    last = parse_lsn(info["last_record_lsn"])
    assert last > parse_lsn("0/1000000")
    assert info["ancestor_timeline_id"] is None and info["pg_version"] == 15
    # bootstrap flushes: everything is durable
    assert info["disk_consistent_lsn"] == info["last_record_lsn"]

    # duplicate timeline id
    status, err = node.request("POST", f"/v1/tenant/{tenant}/timeline", {"new_timeline_id": timeline})
    assert status == 409, err

    # a branch at the ancestor's end, with a chosen id
    branch_id = "fedcba9876543210fedcba9876543210"
    status, branch = node.request(
        "POST", f"/v1/tenant/{tenant}/timeline",
        {"new_timeline_id": branch_id, "ancestor_timeline_id": timeline, "ancestor_start_lsn": info["last_record_lsn"]},
    )
    assert status == 201, branch
    assert branch["ancestor_timeline_id"] == timeline
    assert branch["ancestor_lsn"] == info["last_record_lsn"] == branch["last_record_lsn"]

    status, listed = node.request("GET", f"/v1/tenant/{tenant}/timeline")
    assert status == 200 and {t["timeline_id"] for t in listed} == {timeline, branch_id}

    # bad branch requests
    status, err = node.request(
        "POST", f"/v1/tenant/{tenant}/timeline",
        {"ancestor_timeline_id": "00" * 16},
    )
    assert status == 404, err
    status, err = node.request(
        "POST", f"/v1/tenant/{tenant}/timeline",
        {"ancestor_timeline_id": timeline, "ancestor_start_lsn": "1/0"},
    )
    assert status == 400 and "above" in err["msg"], err
    status, err = node.request(
        "POST", f"/v1/tenant/{tenant}/timeline",
        {"ancestor_timeline_id": timeline, "ancestor_start_lsn": "zz"},
    )
    assert status == 400, err
    status, err = node.request("POST", f"/v1/tenant/{tenant}/timeline", {"pg_version": 14})
    assert status == 400, err
    # A branch point below the ancestor's first record (a digit dropped from the LSN): there is
    # no data directory there to branch from, and no timeline is left behind.
    status, err = node.request(
        "POST", f"/v1/tenant/{tenant}/timeline",
        {"ancestor_timeline_id": timeline, "ancestor_start_lsn": "0/8"},
    )
    assert status == 400 and "no data directory" in err["msg"], err
    status, listed = node.request("GET", f"/v1/tenant/{tenant}/timeline")
    assert status == 200 and {t["timeline_id"] for t in listed} == {timeline, branch_id}
    status, err = node.request("GET", f"/v1/tenant/{tenant}/timeline/{'12' * 16}")
    assert status == 404, err


def test_keyspace(node: NodeProcess, bootstrapped: tuple[str, str]) -> None:
    tenant, timeline = bootstrapped
    status, ks = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}/keyspace")
    assert status == 200, ks
    ranges = [(key_parse_hex(r["start"]), key_parse_hex(r["end"])) for r in ks["keys"]]
    assert ranges == sorted(ranges)
    rel_blocks = [r for r in ranges if is_rel_block_key(r[0])]
    assert rel_blocks
    # pg_class (relfilenode 1259) of database 5 ("postgres"): a rel-block range starts at block 0
    start = "000000067F000000050000" + "04EB" + "0000000000"
    assert any(k[0].hex().upper() == start.upper() for k in rel_blocks), start
    status, err = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}/keyspace?at_lsn=FF/0")
    assert status == 400, err
    # Before the timeline's first record there is no keyspace to list.
    status, err = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}/keyspace?at_lsn=0/8")
    assert status == 400 and "no data directory" in err["msg"], err


def test_relations_listing(node: NodeProcess, bootstrapped: tuple[str, str]) -> None:
    tenant, timeline = bootstrapped
    status, listing = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}/relations")
    assert status == 200, listing
    dbs = {(d["spcnode"], d["dbnode"]): d for d in listing["databases"]}
    assert (1664, 0) in dbs and (1663, 5) in dbs
    rels = {r["relnode"]: r["forks"] for r in dbs[(1663, 5)]["relations"]}
    assert rels[1259]["main"] > 0  # pg_class of "postgres"
    status, err = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}/relations?at_lsn=0/8")
    assert status == 400 and "no data directory" in err["msg"], err


def test_checkpoint_and_compact(node: NodeProcess, bootstrapped: tuple[str, str]) -> None:
    tenant, timeline = bootstrapped
    status, info = node.request("PUT", f"/v1/tenant/{tenant}/timeline/{timeline}/checkpoint")
    assert status == 200, info
    assert info["disk_consistent_lsn"] == info["last_record_lsn"]
    status, info = node.request("PUT", f"/v1/tenant/{tenant}/timeline/{timeline}/compact")
    assert status == 200, info
    status, gc = node.request("PUT", f"/v1/tenant/{tenant}/timeline/{timeline}/do_gc")
    assert status == 200 and gc["layers_removed"] >= 0


def test_import_timeline(node: NodeProcess, tmp_path: Path) -> None:
    from compute.postgres import initdb

    status, body = node.request("POST", "/v1/tenant", {})
    tenant = body["tenant_id"]
    pgdata = node.workdir.parent / "import-src"
    initdb(pgdata)
    status, info = node.request("POST", f"/v1/tenant/{tenant}/timeline/import", {"source": str(pgdata)})
    assert status == 201, info
    assert parse_lsn(info["last_record_lsn"]) > parse_lsn("0/1000000")
    assert info["disk_consistent_lsn"] == info["last_record_lsn"]

    not_pg = tmp_path / "empty"
    not_pg.mkdir()
    for body_, code in (
        ({"source": str(tmp_path / "missing")}, 400),
        ({"source": "relative/dir"}, 400),
        ({"source": str(not_pg), "new_timeline_id": "ab" * 16}, 400),
        ({}, 400),
    ):
        status, err = node.request("POST", f"/v1/tenant/{tenant}/timeline/import", body_)
        assert status == code and err["msg"], (body_, err)
    # the failed import left nothing behind
    status, listed = node.request("GET", f"/v1/tenant/{tenant}/timeline")
    assert [t["timeline_id"] for t in listed] == [info["timeline_id"]]
