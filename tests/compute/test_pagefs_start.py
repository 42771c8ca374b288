"""``pagestore pagefs --start-lsn -``: the control plane spawns the page filesystem before it
knows the start LSN and writes it to the process's stdin; a pipe closed first (the endpoint
start failed or died) ends the process without mounting anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from control_plane import process

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")


def test_stdin_closed_before_the_start_lsn_ends_it_unmounted(tmp_path: Path) -> None:
    mnt, backing = tmp_path / "mnt", tmp_path / "backing"
    mnt.mkdir()
    backing.mkdir()
    status = tmp_path / "status.json"
    cmd = process.cli_command(
        "pagefs", "--mountpoint", str(mnt), "--backing", str(backing), "--pgdata", str(tmp_path / "pgdata"),
        "--cache-file", str(tmp_path / "cache.pages"), "--pageserver", "127.0.0.1:1",
        "--pageserver-http", "http://127.0.0.1:1", "--tenant-id", "00" * 16, "--timeline-id", "00" * 16,
        "--start-lsn", "-", "--status-file", str(status), "--log-file", str(tmp_path / "pagefs.log"),
    )
    proc = subprocess.run(cmd, cwd=process.ROOT, input=b"", capture_output=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "stdin closed before the start LSN came" in (tmp_path / "pagefs.log").read_text() + proc.stderr.decode()
    assert not os.path.ismount(mnt) and not status.exists() and not (tmp_path / "pgdata").exists()
