"""The ``O_DIRECT`` write of a WAL segment piece through an aligned staging buffer: the
reference twin of ``safekeeper/_direct_write_c.pyx`` (same names, results, error classes).

``write_staged(fd, stage, head, chunks, start, sync)`` writes ``head`` bytes already at the
start of ``stage`` (the bytes of the file in ``[start, start + head)``) followed by the bytes
of ``chunks``, at file offset ``start``, in steps of at most ``len(stage)`` bytes:

- every step's last block is padded with zeros up to ``ALIGN`` (what a preallocated segment
  holds past the end of WAL anyway), and every step after the first starts on a block;
- after the last step the bytes of its last, partial block (if any) are moved to the start of
  ``stage``, and their count is returned: the ``head`` of the next write at the block where
  this one ended;
- ``sync``: one ``fdatasync(fd)`` after the last step, so a caller on a WAL writer thread
  learns the piece is durable from the same call.

The compiled twin does all of it (copies, writes, the sync) in one stretch without the GIL:
a writer thread that took the GIL back after each system call would wait for it every time
the event loop's thread holds it (docs/safekeeper.md, "the GIL").

Errors: ``ValueError`` for arguments that break the alignment rules (``start`` or the length
or address of ``stage`` not a multiple of ``ALIGN``, ``head`` outside ``[0, ALIGN)``, a
``stage`` shorter than two blocks or read-only); ``OSError`` with the call's ``errno`` for a
failed ``pwrite`` or ``fdatasync`` (``ENOSPC`` for a write that made no progress, as
PostgreSQL assumes), after which the file's content in the range is unknown.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

__all__ = ["ALIGN", "IMPL", "write_staged"]

IMPL: Final = "python"
# The unit of O_DIRECT offsets, lengths and buffer addresses (4096 covers every logical block
# size Linux filesystems use for it).
ALIGN: Final = 4096
_ZEROS: Final = bytes(ALIGN)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def check_arguments(stage: memoryview, head: int, start: int) -> None:
    if stage.readonly:
        raise ValueError("the staging buffer is read-only")
    if len(stage) < 2 * ALIGN or len(stage) % ALIGN:
        raise ValueError(f"the staging buffer's length {len(stage)} is not a multiple of {ALIGN} of at least two blocks")
    if _address(stage) % ALIGN:
        raise ValueError(f"the staging buffer is not aligned to {ALIGN} bytes")
    if not 0 <= head < ALIGN:
        raise ValueError(f"head {head} is outside [0, {ALIGN})")
    if start < 0 or start % ALIGN:
        raise ValueError(f"file offset {start} is not a non-negative multiple of {ALIGN}")


def write_staged(
    fd: int, stage: Buffer, head: int, chunks: Sequence[Buffer], start: int, sync: bool
) -> int:
    """See the module docstring; returns the bytes kept at the start of ``stage``."""
    view = memoryview(stage).cast("B")
    check_arguments(view, head, start)
    pending = [memoryview(c).cast("B") for c in chunks]
    size = len(view)
    index = 0
    at = 0  # bytes of pending[index] already staged
    fill = head
    while True:
        while fill < size and index < len(pending):
            buf = pending[index]
            take = min(len(buf) - at, size - fill)
            view[fill : fill + take] = buf[at : at + take]
            fill += take
            at += take
            if at == len(buf):
                index += 1
                at = 0
        last = index >= len(pending)
        if fill == 0:
            break
        padded = -(-fill // ALIGN) * ALIGN
        view[fill:padded] = _ZEROS[: padded - fill]
        _pwrite_all(fd, view[:padded], start)
        kept = fill % ALIGN
        if last:
            if kept:
                view[:kept] = view[fill - kept : fill]
            break
        # A full stage is a whole number of blocks: the next step starts on a block.
        start += fill
        fill = 0
    if sync:
        os.fdatasync(fd)
    return fill % ALIGN if fill else 0


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"pwrite wrote nothing at offset {offset + done}")
        done += n
