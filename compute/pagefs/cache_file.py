"""The local page file (the local file cache): 8 KiB slots in one file, a free list, and the
clock over the slots. The page store (``compute.pagefs.store``) owns the index from blocks to
slots; this module only stores bytes and keeps the clock's reference bits.

The file is scratch: it is truncated when the page filesystem starts (a fresh endpoint never
trusts an earlier run's cache, as Neon's LFC) and removed when it stops. Reads and writes are
``os.pread``/``os.pwrite`` on the trio thread: one 8 KiB copy to the kernel's page cache, cheaper
than a thread hop.
"""

from __future__ import annotations

import os
from pathlib import Path

from compute.pagefs.page_header import BLCKSZ


class LocalPageFile:
    def __init__(self, path: Path, capacity_pages: int) -> None:
        if capacity_pages < 1:
            raise ValueError("the local cache must hold at least one page")
        self.path = path
        self.capacity = capacity_pages
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._free: list[int] = []
        self._next = 0  # slots below were handed out at least once
        self.ref = bytearray()  # clock reference bit per slot
        self.used = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)

    @property
    def slots(self) -> int:
        """Slots handed out so far (the clock's range)."""
        return self._next

    def full(self) -> bool:
        return not self._free and self._next >= self.capacity

    def allocate(self) -> int:
        """A free slot; beyond ``capacity`` only when the caller found nothing to evict."""
        self.used += 1
        if self._free:
            return self._free.pop()
        slot = self._next
        self._next += 1
        self.ref.append(1)
        return slot

    def release(self, slot: int) -> None:
        self.used -= 1
        self.ref[slot] = 0
        self._free.append(slot)

    def write(self, slot: int, page: bytes | memoryview) -> None:
        n = os.pwrite(self._fd, page, slot * BLCKSZ)
        if n != BLCKSZ:
            raise OSError(f"short write to the local page file ({n} of {BLCKSZ} bytes)")
        self.ref[slot] = 1

    def read(self, slot: int) -> bytes:
        data = os.pread(self._fd, BLCKSZ, slot * BLCKSZ)
        if len(data) != BLCKSZ:
            raise OSError(f"short read from the local page file ({len(data)} of {BLCKSZ} bytes)")
        self.ref[slot] = 1
        return data
