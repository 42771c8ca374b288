"""Attach / detach over the HTTP API with a storage controller: a tenant moves from one
pageserver process to another (same remote storage) with a new generation, pages equal; a
restarted node re-attaches its tenants in a newer generation."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.ports import free_port
from tests.pageserver.node_helpers import REPO, running_node
from tests.pageserver.test_node import _bootstrap, _copy_out
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres

# pg_control and the WAL segment are made per request (the checkpoint record's time, and the
# previous record's LSN, known only for WAL this process ingested itself); every relation
# file, SLRU and map is the data and must be equal.
GENERATED = {"global/pg_control", "pg_wal/000000010000000000000001"}


def _files(tar: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            if f is not None:
                out[m.name] = f.read()
    return out


def _call(url: str, method: str = "GET", body: object = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@contextmanager
def storage_controller(workdir: Path) -> Iterator[str]:
    workdir.mkdir(parents=True)
    port = free_port()
    config = workdir / "storage_controller.toml"
    config.write_text(f'workdir = "{workdir}"\nlisten_http_addr = "127.0.0.1:{port}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "control_plane.cli", "storage-controller", "-c", str(config)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(workdir / "stderr.txt", "ab"),  # noqa: SIM115
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _call(url + "/v1/status")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((workdir / "stderr.txt").read_text()) from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_tenant_moves_between_pageservers(tmp_path: Path) -> None:
    with pg_tmpdir("pagestore-migrate-") as base, storage_controller(base / "sc") as sc:
        remote = base / "remote"
        extra = f'remote_storage = {{kind = "local", path = "{remote}"}}\ncontrol_plane_api = "{sc}/upcall/v1/"\n'
        with running_node(base / "ps1", extra + "id = 1\n") as ps1, running_node(base / "ps2", extra + "id = 2\n") as ps2:
            tenant, timeline, lsn = _bootstrap(ps1)
            assert _call(f"{sc}/control/v1/tenant") == {"tenants": [{"id": tenant, "gen": 1, "node_id": 1}]}
            before = _files(_copy_out(ps1, f"fullbackup {tenant} {timeline} {lsn}"))

            gen = _call(f"{sc}/control/v1/tenant/{tenant}/attach", "POST", {"node_id": 2})
            assert gen == {"gen": 2}
            status, info = ps2.request("POST", f"/v1/tenant/{tenant}/attach", {"generation": 2})
            assert status == 201, info
            status, tl = ps2.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
            assert status == 200, tl
            assert tl["last_record_lsn"] == tl["remote_consistent_lsn"] == lsn
            after = _files(_copy_out(ps2, f"fullbackup {tenant} {timeline} {lsn}"))
            assert [n for n in before if n not in GENERATED and before[n] != after.get(n)] == []

            # attaching twice is refused; the old node lets go
            status, _ = ps2.request("POST", f"/v1/tenant/{tenant}/attach", {"generation": 2})
            assert status == 409
            status, body = ps1.request("POST", f"/v1/tenant/{tenant}/detach")
            assert status == 200, body
            assert ps1.request("GET", f"/v1/tenant/{tenant}")[0] == 404
            assert not (base / "ps1" / "tenants" / tenant).exists()

            # a restart of node 2 re-attaches it in a newer generation; node 1 gets nothing
            ps2.stop()
            ps2.start()
            assert _call(f"{sc}/control/v1/tenant") == {"tenants": [{"id": tenant, "gen": 3, "node_id": 2}]}
            status, tl = ps2.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
            assert status == 200 and tl["last_record_lsn"] == lsn, tl
            ps1.stop()
            ps1.start()
            assert ps1.request("GET", "/v1/tenant")[1] == []
