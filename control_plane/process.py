"""Background processes of the local cluster: spawn detached, pid files, liveness, stop.

Nodes run as ``python -m control_plane.cli <node> -c FILE`` in their own session (so a Ctrl-C in
the terminal that ran ``pagestore start`` does not reach them), stdout and stderr appended to
``stdout.log`` in the node's directory, the pid in ``pid``. ``stop`` sends SIGTERM (the nodes
shut down cleanly on it) and SIGKILL after a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from control_plane.http_client import ApiError, get_json

ROOT = Path(__file__).resolve().parents[1]


class ProcessError(Exception):
    """A process did not start or stop as asked; the message says which and why."""


def cli_command(*args: str) -> list[str]:
    """The command line that runs a ``pagestore`` subcommand with this interpreter."""
    return [sys.executable, "-m", "control_plane.cli", *args]


def spawn(cmd: Sequence[str], *, log_path: Path, pid_path: Path, cwd: Path | None = None) -> int:
    """Start ``cmd`` detached; returns its pid (also written to ``pid_path``)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd or ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pid_path.write_text(f"{proc.pid}\n")
    return proc.pid


def read_pid(pid_path: Path) -> int | None:
    try:
        return int(pid_path.read_text().strip())
    except (OSError, ValueError):
        return None


def _reap(pid: int) -> None:
    # A process we spawned ourselves (tests run the CLI in-process) stays a zombie until waited.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def is_alive(pid: int) -> bool:
    _reap(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may itself contain ") ".
    state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3]
    return state not in (b"Z", b"X")


def running_pid(pid_path: Path) -> int | None:
    pid = read_pid(pid_path)
    return pid if pid is not None and is_alive(pid) else None


def stop_pid(pid: int, *, timeout: float = 10.0, what: str = "process") -> str:
    """SIGTERM, then SIGKILL after ``timeout``; returns how it ended ("terminated"/"killed")."""
    if not is_alive(pid):
        return "not running"
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "not running"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return "terminated"
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "terminated"
    deadline = time.monotonic() + 5
    while is_alive(pid):
        if time.monotonic() > deadline:
            raise ProcessError(f"{what} (pid {pid}) survived SIGKILL")
        time.sleep(0.05)
    return "killed"


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} not readable)"
    return "\n".join(text.splitlines()[-lines:])


def wait_until(what: str, cond: Callable[[], bool], *, timeout: float, pid: int | None = None,
               log_path: Path | None = None) -> None:
    """Poll ``cond``; fail early (with the log's tail) when the process behind it dies."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        if pid is not None and not is_alive(pid):
            detail = f"\n--- last lines of {log_path} ---\n{tail(log_path)}" if log_path else ""
            raise ProcessError(f"{what}: the process (pid {pid}) exited{detail}")
        if time.monotonic() > deadline:
            detail = f"\n--- last lines of {log_path} ---\n{tail(log_path)}" if log_path else ""
            raise ProcessError(f"{what}: not ready after {timeout:.0f} s{detail}")
        time.sleep(0.1)


def http_answers(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            get_json(url, timeout=1.0)
        except (ApiError, OSError):
            return False
        return True

    return check
