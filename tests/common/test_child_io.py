"""The worker children's watchdog (``common.child_io.start_watchdog``): a child whose parent
is already gone when it starts (it died while the child was still importing) ends at once
(the L0 writer, the one worker child); ``read_exact`` tells a clean EOF from a cut message."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.child_io import read_exact

ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_child_whose_parent_is_gone_exits() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "pageserver.storage.l0_worker", f"--parent-pid={_dead_pid()}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )
    try:
        # (stdin stays open: only the watchdog can end it)
        assert child.wait(timeout=20) == 3
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.stdout.close()


def test_read_exact() -> None:
    assert read_exact(io.BytesIO(b"abcdef"), 4) == bytearray(b"abcd")
    assert read_exact(io.BytesIO(b""), 4) is None
    with pytest.raises(EOFError, match="2 bytes into a 4-byte read"):
        read_exact(io.BytesIO(b"ab"), 4)
