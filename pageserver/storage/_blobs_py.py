"""The blob gather of a vectored read (kernel 3), pure Python: the reference twin of
``pageserver/storage/_blobs_c.pyx``.

``gather_blobs`` performs the reads a vectored walk planned (``delta_layer.execute_reads``):
one ``preadv`` per read into one buffer, then, per blob of that read, the bounds and the
CRC-32C of its index entry are checked and the blob is handed out: an image (tag 0) as the
bare page bytes (the copy the response needs anyway), any other value as its whole encoding
(tag included) for the value decoders.

Cold reads are not done one disk round trip after another: reads are tried with
``RWF_NOWAIT`` until one finds its data missing from the page cache; then
``POSIX_FADV_WILLNEED`` asks the kernel for it and every later read at once (the disk serves
them concurrently), and the reads wait for their data in turn. ``probe`` says whether to try
``RWF_NOWAIT`` at all; the result says whether it is still worth trying (False once a file
system refused the flag).

Arguments: ``reads`` is one ``(reader, file offset, total bytes, first slot, blob count)``
per read (the planner's ``ReadContext.reads``), the reads' slots consecutive from 0 in order;
``fd_of(reader)`` gives a reader's descriptor (called once per run of reads of the same
reader object, before any read: it may raise, e.g. for a closed file); ``blobs`` is ``(file
offset, length, crc32c)`` per slot. Returns ``(values, kinds, calls, probe, bytes)``: one
value per slot, ``kinds[slot]`` 1 where the value is an image's page and 0 where it is an
encoded value, the number of ``preadv`` calls, the new ``probe``, and the bytes read.

Errors: ``ShortRead`` (the file ended inside a read), ``BlobOutsideRead`` (an index entry
that does not lie inside its read), ``BlobChecksumError`` (a CRC mismatch), each naming the
read and slot; the caller turns them into ``LayerCorruptionError`` naming the file. Any other
``OSError`` of the syscalls is raised as it is. The native kernel does the syscalls and the
checks without the GIL.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from typing import Any, Final

from crc32c import crc32c

__all__ = ["IMPL", "BlobChecksumError", "BlobOutsideRead", "ShortRead", "gather_blobs"]

IMPL: Final = "python"
TAG_IMAGE: Final = 0
_HAVE_NOWAIT: Final = hasattr(os, "RWF_NOWAIT")


class ShortRead(ValueError):
    """The file ended inside a planned read: ``(read index, bytes got, bytes wanted)``."""


class BlobOutsideRead(ValueError):
    """An index entry's blob does not lie inside the read planned for it."""


class BlobChecksumError(ValueError):
    """A blob's bytes do not have its index entry's CRC-32C: ``(read index, slot)``."""


def _read_all(
    jobs: Sequence[tuple[int, int, int]], probe: bool
) -> tuple[list[tuple[bytearray, int]], int, bool]:
    out: list[tuple[bytearray, int]] = []
    calls = 0
    probe = probe and _HAVE_NOWAIT
    supported = True
    for n, (fd, offset, total) in enumerate(jobs):
        buf = bytearray(total)
        got = 0
        if probe:
            calls += 1
            try:
                got = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
            except BlockingIOError:
                got = 0
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                probe = supported = False
            if got < total and probe:
                probe = False
                if n + 1 < len(jobs):  # (one read alone gains nothing from it)
                    for fd2, offset2, total2 in jobs[n:]:
                        os.posix_fadvise(fd2, offset2, total2, os.POSIX_FADV_WILLNEED)
        while got < total:
            calls += 1
            more = os.preadv(fd, [memoryview(buf)[got:]] if got else [buf], offset + got)
            if more == 0:
                break
            got += more
        out.append((buf, got))
    return out, calls, supported


def gather_blobs(
    reads: Sequence[tuple[Any, int, int, int, int]],
    blobs: Sequence[tuple[int, int, int]],
    fd_of: Callable[[Any], int],
    probe: bool,
) -> tuple[list[bytes], bytes, int, bool, int]:
    """Perform the planned reads and hand out their checked blobs: see the module docstring."""
    expected = 0
    jobs: list[tuple[int, int, int]] = []
    spans: list[tuple[int, int]] = []
    last: Any = None
    fd = -1
    for n, (reader, offset, total, first, count) in enumerate(reads):
        if first != expected or count < 0:
            raise ValueError(f"span ({first}, {count}) does not follow slot {expected}")
        expected += count
        if total < 0 or offset < 0:
            raise ValueError(f"read {n}: offset {offset}, length {total}")
        if not jobs or reader is not last:
            fd, last = fd_of(reader), reader
        jobs.append((fd, offset, total))
        spans.append((first, count))
    if expected != len(blobs):
        raise ValueError(f"spans cover {expected} slots of {len(blobs)}")
    results, calls, supported = _read_all(jobs, probe)
    values: list[bytes] = []
    kinds = bytearray(len(blobs))
    for n, ((_fd, offset, total), (first, count), (buf, got)) in enumerate(
        zip(jobs, spans, results, strict=True)
    ):
        if got != total:
            raise ShortRead(n, got, total)
        view = memoryview(buf)
        for slot in range(first, first + count):
            off, length, crc = blobs[slot]
            start = off - offset
            if start < 0 or length < 0 or start + length > total:
                raise BlobOutsideRead(n, slot)
            data = view[start : start + length]
            if crc32c(data) != crc:
                raise BlobChecksumError(n, slot)
            if length and data[0] == TAG_IMAGE:
                values.append(bytes(data[1:]))
                kinds[slot] = 1
            else:
                values.append(bytes(data))
    return values, bytes(kinds), calls, supported, sum(total for _, _, total in jobs)
