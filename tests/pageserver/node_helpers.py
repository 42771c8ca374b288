"""Run a pageserver node as a subprocess for tests: config on free ports, an HTTP helper,
graceful stop (SIGTERM) with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from compute.postgres import free_port

REPO = Path(__file__).resolve().parents[2]


@attrs.define
class NodeProcess:
    workdir: Path
    pg_port: int
    http_port: int
    config_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def configure(cls, workdir: Path, extra: str = "") -> NodeProcess:
        workdir.mkdir(parents=True, exist_ok=True)
        pg_port, http_port = free_port(), free_port()
        while http_port == pg_port:  # two bind(0) probes may hand out the same port
            http_port = free_port()
        config = workdir / "pageserver.toml"
        config.write_text(
            f'workdir = "{workdir}"\n'
            f'listen_pg_addr = "127.0.0.1:{pg_port}"\n'
            f'listen_http_addr = "127.0.0.1:{http_port}"\n'
            'log_file = "pageserver.log"\n'
            "shutdown_timeout_s = 2.0\n" + extra
        )
        return cls(workdir, pg_port, http_port, config)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def log_text(self) -> str:
        path = self.workdir / "pageserver.log"
        return path.read_text() if path.exists() else ""

    def start(self, timeout: float = 90.0) -> NodeProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "pageserver", "-c", str(self.config_path)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=open(self.workdir / "stderr.txt", "ab"),  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pageserver exited with {self.proc.returncode}: "
                    f"{(self.workdir / 'stderr.txt').read_text()[-3000:]}"
                )
            try:
                self.request("GET", "/v1/status")
                return self
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError("pageserver did not start")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills after ``timeout``)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                timeout: float = 120.0) -> tuple[int, Any]:
        """(status, parsed JSON or text) of one HTTP request."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, payload, ctype = resp.status, resp.read(), resp.headers.get("content-type", "")
        except urllib.error.HTTPError as err:
            status, payload, ctype = err.code, err.read(), err.headers.get("content-type", "")
        if "json" in ctype:
            return status, json.loads(payload)
        return status, payload.decode()


@contextmanager
def running_node(workdir: Path, extra: str = "") -> Iterator[NodeProcess]:
    """A started node for the block's duration: stopped gracefully (if still running) at the
    end, and killed if that fails."""
    proc = NodeProcess.configure(workdir, extra).start()
    try:
        yield proc
    finally:
        try:
            proc.stop()
        finally:
            proc.kill()
