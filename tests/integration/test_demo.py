"""``pagestore demo`` as a user runs it (a process), smaller: scale 1, a 4 s pgbench, ``--stop``.

The demo checks its own results and exits non-zero naming the failing step; here we also read
the numbers it wrote (``--json-result``) and check that they say what the demo claims, and that
a failure is loud: a directory the demo did not make is refused with exit code 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from control_plane.local_env import LocalEnv
from control_plane.process import is_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]


def run_demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "control_plane.cli", "demo", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.postgres
@pytest.mark.slow
def test_demo_runs_and_checks(pg_tmp_path: Path) -> None:
    workdir = pg_tmp_path / "demo"
    result_path = pg_tmp_path / "result.json"
    # lazy branch and read-only endpoints need FUSE; without it the demo is asked for full ones
    lazy = os.path.exists("/dev/fuse") and os.geteuid() == 0
    proc = run_demo("--workdir", str(workdir), "--free-ports", "--scale", "1", "--duration", "8",
                    "--clients", "2", "--stop", "--json-result", str(result_path),
                    "--storage", "lazy" if lazy else "full")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "every check passed" in proc.stdout
    # main is full (its files are the page check's reference); the others are lazy endpoints
    assert "endpoint main: full storage, started in" in proc.stdout
    kind = "lazy" if lazy else "full"
    assert f"endpoint half: {kind} storage, started in" in proc.stdout
    assert f"endpoint static: {kind} storage, started in" in proc.stdout
    r = json.loads(result_path.read_text())
    half, seen = r["half_way"], r["branch_sees"]
    assert (seen["sum_abalance"], seen["history_count"]) == (half["sum_abalance"], half["history_count"])
    end = r["main_at_end"]
    assert (end["sum_abalance"], end["history_count"]) != (half["sum_abalance"], half["history_count"])
    quarter, ro = r["quarter_way"], r["read_only_sees"]
    assert (ro["sum_abalance"], ro["history_count"]) == (quarter["sum_abalance"], quarter["history_count"])
    assert r["transactions"] > 0 and r["tps"] > 0
    assert len(r["pages"]) >= 6 and all(p["equal"] for p in r["pages"])
    assert {p["relation"] for p in r["pages"]} == {"pgbench_accounts", "pgbench_branches", "pgbench_accounts_pkey"}
    # --stop left nothing running.
    env = LocalEnv.load(workdir)
    for _, node_dir in env.node_dirs():
        pid = read_pid(node_dir / "pid")
        assert pid is not None and not is_alive(pid)
    assert not list(workdir.glob("endpoints/*/pgdata/postmaster.pid"))
    assert not any(os.path.ismount(m) for m in workdir.glob("endpoints/*/pagefs/mnt"))


def test_demo_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    proc = run_demo("--workdir", str(tmp_path / "mine"), "--free-ports", timeout=120)
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout and "initialize the cluster directory" in proc.stdout
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep me"
