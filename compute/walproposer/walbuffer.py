"""The bridge's window of WAL received from PostgreSQL, shared by every safekeeper sender.

One replication stream from PostgreSQL fills the window; each safekeeper connection reads
from its own position. The window keeps the newest ``capacity`` bytes at most (trimmed in
halves so compaction stays amortised O(1) per byte); a safekeeper whose position fell out of
it catches up from PostgreSQL on a stream of its own. Pure: no IO, no trio.
"""

from __future__ import annotations

from protocol.errors import LocalProtocolError
from protocol.lsn import Lsn, format_lsn


class WalNotBuffered(Exception):
    """The requested LSN is older than the window: it has been trimmed."""


class WalBuffer:
    """WAL bytes for the LSN range [start, end), appended strictly in order."""

    __slots__ = ("_buf", "_head", "capacity", "start")

    def __init__(self, start: Lsn, capacity: int = 64 * 1024 * 1024) -> None:
        if capacity < 2:
            raise ValueError("capacity too small")
        self.start = start
        self.capacity = capacity
        self._buf = bytearray()
        self._head = 0  # index in _buf of the byte at ``start``

    @property
    def end(self) -> Lsn:
        return Lsn(self.start + len(self._buf) - self._head)

    def __len__(self) -> int:
        return len(self._buf) - self._head

    def append(self, lsn: Lsn, data: bytes | bytearray | memoryview) -> None:
        """Add WAL at ``lsn``; bytes we already hold (a resent overlap) are skipped."""
        end = self.end
        if lsn > end:
            raise LocalProtocolError(f"WAL gap: have up to {format_lsn(end)}, got {format_lsn(lsn)}")
        skip = end - lsn
        if skip >= len(data):
            return
        self._buf += memoryview(data)[skip:]
        if len(self) > self.capacity:
            self.trim(Lsn(self.end - self.capacity // 2))

    def read(self, lsn: Lsn, max_len: int) -> bytes:
        """Up to ``max_len`` bytes from ``lsn`` (empty at the end of the window)."""
        if lsn < self.start:
            raise WalNotBuffered(f"{format_lsn(lsn)} is before the window at {format_lsn(self.start)}")
        if lsn > self.end:
            raise LocalProtocolError(f"read at {format_lsn(lsn)} beyond end {format_lsn(self.end)}")
        i = self._head + (lsn - self.start)
        return bytes(self._buf[i : i + max_len])

    def trim(self, upto: Lsn) -> None:
        """Forget WAL before ``upto`` (clamped to the window)."""
        upto = Lsn(min(max(upto, self.start), self.end))
        self._head += upto - self.start
        self.start = upto
        if self._head > len(self._buf) // 2:
            del self._buf[: self._head]
            self._head = 0

    def reset(self, start: Lsn) -> None:
        """Drop everything and start an empty window at ``start``."""
        self._buf = bytearray()
        self._head = 0
        self.start = start
