"""The child side of the pageserver's worker processes (the L0 writer,
``pageserver.storage.l0_worker``): setting the pipes up, exact reads from the parent's pipe,
and the watchdog that ends an orphan.

Standard library only, so that a child importing it starts fast. The parent side is
``common.children``.
"""

from __future__ import annotations

import fcntl
import io
import os
import threading
import time
from typing import Protocol

# How often the watchdog looks at the parent pid.
WATCHDOG_S = 0.1
# Both sides raise their pipes to this (best effort): a request or an answer of up to this
# size is one write, one wake-up.
PIPE_SIZE = 1 << 20


def raise_pipe_size(fd: int) -> None:
    """``F_SETPIPE_SZ`` to ``PIPE_SIZE`` where the kernel allows it (a smaller pipe only costs
    more wake-ups per message)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass


def open_pipes() -> tuple[io.FileIO, int]:
    """The child's ends: its stdin, unbuffered, and a private copy of its stdout for the
    answers (fd 1 then points to stderr, so that nothing printed by accident lands in an
    answer), raised to ``PIPE_SIZE``."""
    out = os.dup(1)
    os.dup2(2, 1)
    raise_pipe_size(out)
    return open(0, "rb", buffering=0), out


class _Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def read_exact(stream: _Readable, size: int) -> bytearray | None:
    """``size`` bytes from ``stream``; ``None`` at EOF before the first byte (the parent is
    done), ``EOFError`` at EOF in the middle (it died mid-message)."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = stream.readinto(view[got:])
        if not n:
            if got == 0:
                return None
            raise EOFError(f"the pageserver closed the pipe {got} bytes into a {size}-byte read")
        got += n
    return buf


def start_watchdog(parent: int | None, name: str) -> None:
    """End this process (exit status 3) within ``WATCHDOG_S`` once it is orphaned: a parent
    that died mid-job sends no EOF until the job is done, and the job must not go on. Pass
    the parent's pid as the parent gave it on the command line: ``os.getppid()`` after the
    imports would take a parent that died meanwhile for init, its successor."""
    expected = os.getppid() if parent is None else parent

    def watch() -> None:
        while True:
            if os.getppid() != expected:
                os._exit(3)
            time.sleep(WATCHDOG_S)

    threading.Thread(target=watch, name=name, daemon=True).start()
