"""The parent side of the pageserver's worker children (the L0 writer):
starting, stopping and reaping a child process from trio. The child side is
``common.child_io``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from common.child_io import raise_pipe_size

_ROOT = Path(__file__).resolve().parents[1]


async def spawn(module: str, args: Sequence[str], *, pass_fds: Sequence[int] = ()) -> trio.Process:
    """``python -m module --parent-pid=<us> args...`` with this tree on its path, stdin and
    stdout pipes (raised to ``PIPE_SIZE``). Nothing raises after the process exists, so a
    caller that gets an exception has no child to reap."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", module, f"--parent-pid={os.getpid()}", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, pass_fds=pass_fds,
    )
    for stream in (proc.stdin, proc.stdout):
        assert isinstance(stream, trio.lowlevel.FdStream)
        raise_pipe_size(stream.fileno())
    return proc


async def reap(proc: trio.Process) -> None:
    """Kill ``proc`` if it still runs, wait for it, close our ends of its pipes (shielded:
    also from a cancelled scope, a child is never left running or unreaped)."""
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                await stream.aclose()


async def stop(proc: trio.Process, grace_s: float) -> None:
    """End ``proc`` the polite way: EOF on its stdin (the children exit on it), up to
    ``grace_s`` to exit, then ``reap`` (a kill if it is still there). Shielded."""
    with trio.CancelScope(shield=True):
        if proc.stdin is not None:
            await proc.stdin.aclose()
        with trio.move_on_after(grace_s):
            await proc.wait()
    await reap(proc)
