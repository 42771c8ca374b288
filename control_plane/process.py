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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from control_plane.http_client import ApiError, get_json

ROOT = Path(__file__).resolve().parents[1]


class ProcessError(Exception):
    """A process did not start or stop as asked; the message says which and why."""


def cli_command(*args: str) -> list[str]:
    """The command line that runs a ``pagestore`` subcommand with this interpreter."""
    return [sys.executable, "-m", "control_plane.cli", *args]


def spawn(cmd: Sequence[str], *, log_path: Path, pid_path: Path, cwd: Path | None = None,
          env: Mapping[str, str] | None = None) -> int:
    """Start ``cmd`` detached; returns its pid (also written to ``pid_path``). ``env`` is added
    to this process's environment (secrets such as tokens go there, never into ``cmd``)."""
    return _spawn(cmd, log_path=log_path, pid_path=pid_path, cwd=cwd, env=env, stdin=subprocess.DEVNULL).pid


def spawn_piped(cmd: Sequence[str], *, log_path: Path, pid_path: Path, cwd: Path | None = None,
                env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``spawn``, with a pipe to the process's stdin: for a process started before everything
    it needs is known (it reads the rest from the pipe, and sees EOF if this process dies)."""
    return _spawn(cmd, log_path=log_path, pid_path=pid_path, cwd=cwd, env=env, stdin=subprocess.PIPE)


def _spawn(cmd: Sequence[str], *, log_path: Path, pid_path: Path, cwd: Path | None,
           env: Mapping[str, str] | None, stdin: int) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd or ROOT,
            env=None if env is None else {**os.environ, **env},
            stdin=stdin,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # The start time goes with the pid: a stale pid file must not make `stop` signal an
    # unrelated process that was later given the same pid.
    started = start_time(proc.pid)
    pid_path.write_text(f"{proc.pid}" + (f" {started}" if started is not None else "") + "\n")
    return proc


def _read_pid_file(pid_path: Path) -> tuple[int, int | None] | None:
    try:
        fields = pid_path.read_text().split()
        pid = int(fields[0])
        started = int(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError, IndexError):
        return None
    return pid, started


def read_pid(pid_path: Path) -> int | None:
    """The pid recorded in ``pid_path`` (whether or not that process still runs)."""
    got = _read_pid_file(pid_path)
    return None if got is None else got[0]


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # Fields after the parenthesised command name start at field 3 (the state).
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
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
    if state == b"X":
        return False
    if state == b"Z":
        # A zombie thread-group leader whose other threads are still exiting: the process
        # still holds its descriptors (its listening ports) until the last thread is gone.
        try:
            return len(os.listdir(f"/proc/{pid}/task")) > 1
        except OSError:
            return False
    return True


def is_exiting(pid: int) -> bool:
    """A zombie thread-group leader whose other threads are still exiting (after a signal):
    ``is_alive`` still counts it (it holds its ports), but it is going."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"Z"


def wait_gone(pid: int, *, timeout: float) -> bool:
    """Wait until ``pid`` is no longer alive; False if it still is after ``timeout``."""
    deadline = time.monotonic() + timeout
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def running_pid(pid_path: Path) -> int | None:
    """The pid of ``pid_path`` if that very process still runs (same pid and start time)."""
    got = _read_pid_file(pid_path)
    if got is None:
        return None
    pid, started = got
    if not is_alive(pid):
        return None
    if started is not None and start_time(pid) != started:
        return None  # the pid was reused by another process
    return pid


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
               log_path: Path | None = None, interval: float = 0.1) -> None:
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
        time.sleep(interval)


def http_answers(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            get_json(url, timeout=1.0)
        except (ApiError, OSError):
            return False
        return True

    return check
