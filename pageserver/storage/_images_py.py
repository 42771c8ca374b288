"""The page service's image fast path in one persistent layer, pure Python: the reference twin
of ``pageserver/storage/_images_c.pyx``.

``read_images`` answers, in one call, the keys of a batch whose newest version below ``cont``
(and at or above ``floor``) in one layer file is a whole page image: the index search, the
reads and the checks that ``PersistentLayer.plan_reads`` + ``execute_reads`` +
``KeyState.resolve`` do for such a key, without a key state, a planned read or a value per key.
It *declines* (``None`` in that key's place) everything else, and the caller answers those keys
with the general read path, which then decides, and words, whatever is wrong:

- the key's block (``bisect_right(fences, key + cont) - 1``) is not in the block cache
  (``blocks``, the ``IndexBlockCache``'s LRU dict, touched on every hit: ``hits`` counts them),
  or the search lands before the first entry of a block that is not the first;
- the key has nothing in ``[floor, cont)`` here: no entry below ``key + cont`` at all, or the
  one just below is another key's or below ``floor``. Such a key is also flagged in
  ``absent`` (a delta layer's walk goes on below ``floor`` with it, an image layer's key is
  missing: the caller decides);
- the entry just below ``key + cont`` is not below ``cont`` (an unsorted index);
- the entry is not will_init, or not ``1 + BLCKSZ`` bytes long (a record to redo, another
  value), or its blob is not inside ``[data_start, data_end)``;
- its blob's tag is not an image's (0) or its bytes do not have the entry's CRC-32C;
- the read came back short: with ``RWF_NOWAIT`` that means the page cache does not hold it
  (a cold batch: the general path's read-ahead serves it) and every later read is declined
  too; ``supported`` is False (and every later read declined) if the file system refuses
  ``RWF_NOWAIT``.

Physically adjacent blobs of consecutive keys (an image layer's neighbouring blocks) are read
with one ``preadv``: per blob, its tag byte into a scratch byte and its page straight into the
bytes object handed out (up to ``MAX_RUN`` blobs per call). Other ``OSError``s are raised as they
are. Bad arguments (a key that is not 18 bytes, LSNs or bounds outside u64, a block whose raw
entries do not match its decoded entries) are ``ValueError``/``TypeError`` from both twins.

Returns ``(pages, absent, hits, preadvs, bytes_read, supported)``; ``absent`` has one byte per
key, 1 where the key has nothing in ``[floor, cont)`` (its page is then None).

``read_images_into(..., out, dest, stride, slots)`` reads each page straight into the bytearray
``out`` at ``dest + slots[i] * stride`` (the page service's response buffer: no bytes object and
no copy per page) and returns ``(placed, absent, hits, preadvs, bytes_read, supported)``,
``placed`` one byte per key, 1 where its page is there. A declined key's slot may have been
written (a page that failed its CRC, a read cut short): the caller fills it. ``out`` must be a
bytearray (``TypeError``), ``stride`` at least ``BLCKSZ``, ``dest`` and every slot inside
``out`` (``ValueError``), all checked before anything is read.
"""

from __future__ import annotations

import bisect
import errno
import os
from collections.abc import MutableMapping, Sequence
from typing import Any, Final

from crc32c import crc32c

__all__ = ["BLCKSZ", "IMPL", "MAX_RUN", "read_images", "read_images_into"]

IMPL: Final = "python"
BLCKSZ: Final = 8192
ENTRY_SIZE: Final = 42  # key 18 | lsn 8 | pos 8 | len 4 | crc32c 4 (layer_file.ENTRY)
MAX_RUN: Final = 256  # blobs per preadv (2 iovecs each, well below IOV_MAX)
_KEY: Final = 18
_PREFIX: Final = 26
_U64: Final = (1 << 64) - 1
_IMAGE_BLOB: Final = 1 + BLCKSZ


def _check_u64(name: str, value: int) -> None:
    if not 0 <= value <= _U64:
        raise ValueError(f"{name} {value} is outside u64")


def _raw_of(block: Any) -> bytes:
    raw = block.raw
    if not isinstance(raw, bytes):
        raise TypeError("an index block's raw entries must be bytes")
    if len(raw) != len(block.prefixes) * ENTRY_SIZE:
        raise ValueError("an index block's raw entries do not match its decoded entries")
    return raw


def _bisect_entries(raw: bytes, n: int, target: bytes) -> int:
    """bisect_left of ``target`` over the raw entries' 26-byte prefixes (Python's midpoints)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if raw[mid * ENTRY_SIZE : mid * ENTRY_SIZE + _PREFIX] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def read_images(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    cont: int,
    floor: int,
    data_start: int,
    data_end: int,
    fd: int,
) -> tuple[list[bytes | None], bytes, int, int, int, bool]:
    """See the module docstring."""
    pages, absent, hits, calls, nbytes, supported = _read(
        fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end, fd, None, 0, 0, ())
    return pages, absent, hits, calls, nbytes, supported


def read_images_into(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    cont: int,
    floor: int,
    data_start: int,
    data_end: int,
    fd: int,
    out: bytearray,
    dest: int,
    stride: int,
    slots: Sequence[int],
) -> tuple[bytes, bytes, int, int, int, bool]:
    """See the module docstring."""
    pages, absent, hits, calls, nbytes, supported = _read(
        fences, n_blocks, blocks, file_id, keys, cont, floor, data_start, data_end, fd, out, dest, stride, slots)
    return bytes(page is not None for page in pages), absent, hits, calls, nbytes, supported


def _read(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    cont: int,
    floor: int,
    data_start: int,
    data_end: int,
    fd: int,
    out: bytearray | None,
    dest: int,
    stride: int,
    slots: Sequence[int],
) -> tuple[list[Any], bytes, int, int, int, bool]:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != _KEY:
            raise ValueError("keys must be 18-byte bytes")
    _check_u64("cont", cont)
    _check_u64("floor", floor)
    _check_u64("data_start", data_start)
    _check_u64("data_end", data_end)
    view: memoryview | None = None
    if out is not None:
        if not isinstance(out, bytearray):
            raise TypeError("out must be a bytearray")
        if stride < BLCKSZ or dest < 0:
            raise ValueError(f"dest {dest} and stride {stride}: pages would overlap or fall outside")
        slots = list(slots)
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        room = len(out) - BLCKSZ - dest if dest <= len(out) else -1
        for slot in slots:
            if not slot >= 0 or room < 0 or slot > room // stride:
                raise ValueError(f"slot {slot} is outside out")
        view = memoryview(out)
    move_to_end = getattr(blocks, "move_to_end", None)
    tail = cont.to_bytes(8, "big")
    hits = 0
    # 1. search: (request index, blob offset, crc) of every key the layer answers with an image
    plan: list[tuple[int, int, int]] = []
    absent = bytearray(len(keys))
    for n, key in enumerate(keys):
        target = key + tail
        blkno = bisect.bisect_right(fences, target) - 1
        if blkno < 0:
            absent[n] = 1  # every entry is above the key's
            continue
        if blkno >= n_blocks:
            continue
        ident = (file_id, blkno)
        block = blocks.get(ident)
        if block is None:
            continue
        if move_to_end is not None:
            move_to_end(ident)
        hits += 1
        raw = _raw_of(block)
        i = _bisect_entries(raw, len(raw) // ENTRY_SIZE, target)
        if i == 0:
            if blkno == 0:
                absent[n] = 1
            continue
        e = raw[(i - 1) * ENTRY_SIZE : i * ENTRY_SIZE]
        lsn = int.from_bytes(e[_KEY:_PREFIX], "big")
        if e[:_KEY] != key or lsn < floor:
            absent[n] = 1
            continue
        if lsn >= cont:
            continue
        pos = int.from_bytes(e[_PREFIX : _PREFIX + 8], "big")
        length = int.from_bytes(e[_PREFIX + 8 : _PREFIX + 12], "big")
        if not pos & 1 or length != _IMAGE_BLOB:
            continue
        off = pos >> 1
        if off < data_start or off > data_end or data_end - off < length:
            continue
        plan.append((n, off, int.from_bytes(e[_PREFIX + 12 : ENTRY_SIZE], "big")))
    # 2. read: runs of adjacent blobs, one preadv each
    pages: list[Any] = [None] * len(keys)
    calls = nbytes = 0
    supported = True
    at = 0
    while at < len(plan):
        end = at + 1
        while end < len(plan) and end - at < MAX_RUN and plan[end][1] == plan[end - 1][1] + _IMAGE_BLOB:
            end += 1
        run = plan[at:end]
        tags = [bytearray(1) for _ in run]
        bufs: list[bytearray | memoryview] = (
            [bytearray(BLCKSZ) for _ in run] if view is None
            else [view[dest + slots[n] * stride : dest + slots[n] * stride + BLCKSZ] for n, _o, _c in run])
        iov: list[bytearray | memoryview] = []
        for tag, buf in zip(tags, bufs, strict=True):
            iov += (tag, buf)
        total = len(run) * _IMAGE_BLOB
        calls += 1
        try:
            got = os.preadv(fd, iov, run[0][1], os.RWF_NOWAIT)
        except BlockingIOError:
            got = 0
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            supported = False
            break
        nbytes += got
        if got != total:
            break  # cold (or the file ended): this run and every later one to the general path
        for (n, _off, crc), tag, buf in zip(run, tags, bufs, strict=True):
            if tag[0] == 0 and crc32c(buf, crc32c(tag)) == crc:
                pages[n] = bytes(buf) if view is None else True
        at = end
    return pages, bytes(absent), hits, calls, nbytes, supported
