"""The parent side of the pageserver's worker children (the L0 writer, the WAL pre-check):
stopping and reaping a child process from trio. The child side is ``common.child_io``."""

from __future__ import annotations

import trio


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
