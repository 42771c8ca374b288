"""``start`` and ``stop`` when things go wrong, without real nodes (fast).

Stand-ins replace the node programs where a real node is not the point: a process that never
answers (a pageserver stuck at start-up) or a tiny HTTP server (a node that came up).

- a node's port held by another process that even answers HTTP: ``start`` refuses with the
  port named, instead of taking that process's answer for the node's;
- a node that does not come up: ``start`` stops what it started, leaves no pid file behind,
  and the next ``start`` begins from the same state;
- ``stop`` also stops a bridge whose PostgreSQL died, and stays idempotent;
- restarting an endpoint whose PostgreSQL died stops the old bridge first (its pid file goes
  with the directory; the two bridges would fight over terms).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cattrs
import pytest

from control_plane import cli, cluster, endpoint, process
from control_plane.local_env import LocalEnv

HTTP_STUB = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
HANG = "import time; time.sleep(120)"


def pagestore(*args: str) -> int:
    return cli.main(list(args))


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LocalEnv]:
    workdir = tmp_path / "c"
    assert pagestore("init", "--workdir", str(workdir), "--free-ports", "--no-sync",
                     "--safekeepers", "1") == 0
    e = LocalEnv.load(workdir)
    try:
        yield e
    finally:
        pagestore("stop", "--workdir", str(workdir), "--immediate")


@contextmanager
def http_squatter(port: int) -> Iterator[None]:
    """Another program answering HTTP 200 on ``port``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = json.dumps({"id": 99}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def node_pids(env: LocalEnv) -> dict[str, int | None]:
    return {name: process.read_pid(d / "pid") for name, d in env.node_dirs()}


def test_start_refuses_a_port_another_program_answers_on(
    env: LocalEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    port = env.config.safekeepers[0].http
    with http_squatter(port):
        capsys.readouterr()
        assert pagestore("start", "--workdir", str(env.workdir)) == 1
        err = capsys.readouterr().err
    assert err.startswith("pagestore: error:") and str(port) in err and "in use" in err, err
    # Nothing runs that `status` or `stop` would not know about.
    for name, pid in node_pids(env).items():
        assert pid is None or not process.is_alive(pid), name


def test_failed_start_stops_what_it_started(
    env: LocalEnv, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def stand_in(e: LocalEnv, name: str) -> tuple[list[str], str]:
        if name == "pageserver":  # stuck before its HTTP port answers
            return [sys.executable, "-c", HANG], e.pageserver_http
        return [sys.executable, "-c", HTTP_STUB, str(e.config.safekeepers[0].http)], e.safekeeper_http(1)

    monkeypatch.setattr(cluster, "_node_cmd", stand_in)
    monkeypatch.setattr(cluster, "START_TIMEOUT_S", 3.0)
    capsys.readouterr()
    assert pagestore("start", "--workdir", str(env.workdir)) == 1
    out, err = capsys.readouterr()
    assert "starting pageserver: not ready" in err, err
    started = {name: process.read_pid(d / "pid") for name, d in env.node_dirs()}
    assert started == {"pageserver": None, "safekeeper_1": None}, out
    # The pids the stand-ins had (from the log lines) are gone.
    pids = [int(w) for line in out.splitlines() if "start failed" in line
            for w in line.replace(")", " ").split() if w.isdigit()]
    assert len(pids) == 2 and not any(process.is_alive(p) for p in pids), out
    # The next start begins from a clean slate: the safekeeper stand-in starts again.
    monkeypatch.setattr(cluster, "START_TIMEOUT_S", 30.0)
    monkeypatch.setattr(
        cluster, "_node_cmd",
        lambda e, name: stand_in(e, "safekeeper_1") if name == "safekeeper_1"
        else ([sys.executable, "-c", HTTP_STUB, str(e.config.pageserver.http)], e.pageserver_http),
    )
    assert pagestore("start", "--workdir", str(env.workdir)) == 0
    assert all(pid is not None and process.is_alive(pid) for pid in node_pids(env).values())


def _endpoint_with_bridge_only(env: LocalEnv, tmp_path: Path) -> int:
    """An endpoint whose PostgreSQL is gone and whose bridge still runs (a stand-in)."""
    spec = endpoint.EndpointSpec(name="main", tenant_id="ab" * 16, timeline_id="cd" * 16,
                                 branch="main", port=1, basebackup_lsn="0/1000028", read_only=False)
    ep_dir = endpoint.endpoint_dir(env, "main")
    ep_dir.mkdir(parents=True)
    (ep_dir / "endpoint.json").write_text(json.dumps(cattrs.unstructure(spec)))
    pid = process.spawn([sys.executable, "-c", HANG], log_path=ep_dir / "bridge.log",
                        pid_path=ep_dir / "bridge.pid", cwd=tmp_path)
    ep = endpoint.load_endpoint(env, "main")
    assert not ep.running() and process.running_pid(ep.bridge_pid_path) == pid
    return pid


def test_stop_ends_a_bridge_whose_postgres_died(env: LocalEnv, tmp_path: Path) -> None:
    pid = _endpoint_with_bridge_only(env, tmp_path)
    try:
        assert pagestore("stop", "--workdir", str(env.workdir)) == 0
        assert not process.is_alive(pid)
        # Idempotent.
        assert pagestore("stop", "--workdir", str(env.workdir)) == 0
    finally:
        process.stop_pid(pid, timeout=1)


def test_endpoint_restart_stops_the_old_bridge(
    env: LocalEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = _endpoint_with_bridge_only(env, tmp_path)
    env.add_branch("ab" * 16, "main", "cd" * 16)
    # The nodes are not needed for what is checked: the start goes on until it asks the
    # safekeepers (down here) where WAL ends, and fails there.
    monkeypatch.setattr(cluster, "require_running", lambda e: None)
    try:
        with pytest.raises(endpoint.EndpointError, match="safekeepers answered"):
            endpoint.start_endpoint(env, "main", log=lambda *a: None)
        assert not process.is_alive(pid)
    finally:
        process.stop_pid(pid, timeout=1)
