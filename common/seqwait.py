"""``SeqWait``: wait until a monotonically increasing number (an LSN) reaches a target.

Many tasks wait for different targets (GetPage@LSN requests waiting for WAL ingest, sender
tasks waiting for the commit LSN). Waiters sit in a min-heap keyed by target, so
``advance(v)`` wakes exactly the waiters with target <= v in O(k log n), instead of testing one
predicate per waiter (neon's ``libs/utils/src/seqwait.rs`` has the same shape).

- ``advance(v)`` must not go backwards (``ValueError``); equal is a no-op.
- ``await wait_for(target, timeout_s=...)`` returns the current value (>= target), raises
  ``SeqWaitTimeout`` naming target, current value and timeout, or ``SeqWaitShutdown`` after
  ``shutdown()``.
- A cancelled waiter leaves a tombstone that is skipped on wake-up and purged when tombstones
  outnumber live waiters.
"""

from __future__ import annotations

import heapq
import itertools

import trio

from protocol.lsn import format_lsn


class SeqWaitTimeout(Exception):
    def __init__(self, target: int, current: int, timeout_s: float, what: str) -> None:
        super().__init__(
            f"timed out after {timeout_s} s waiting for {what} {format_lsn(target)} "
            f"(current {format_lsn(current)})"
        )
        self.target = target
        self.current = current
        self.timeout_s = timeout_s


class SeqWaitShutdown(Exception):
    """The SeqWait was shut down while (or before) waiting."""


class _Waiter:
    __slots__ = ("event", "live")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.live = True


class SeqWait:
    """See the module docstring. ``what`` names the sequence in errors ("last_record_lsn")."""

    def __init__(self, initial: int = 0, *, what: str = "LSN") -> None:
        self._current = initial
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()
        self._live = 0
        self._shutdown = False
        self.what = what

    @property
    def current(self) -> int:
        return self._current

    @property
    def waiters(self) -> int:
        """Waiters currently parked (tombstones excluded)."""
        return self._live

    def advance(self, value: int) -> None:
        if value < self._current:
            raise ValueError(
                f"{self.what} must not go backwards: {format_lsn(value)} < {format_lsn(self._current)}"
            )
        self._current = value
        heap = self._heap
        while heap and heap[0][0] <= value:
            _, _, waiter = heapq.heappop(heap)
            if waiter.live:
                waiter.live = False
                self._live -= 1
                waiter.event.set()

    def shutdown(self) -> None:
        """Wake every waiter with ``SeqWaitShutdown``; later waits fail immediately."""
        self._shutdown = True
        for _, _, waiter in self._heap:
            if waiter.live:
                waiter.live = False
                waiter.event.set()
        self._heap.clear()
        self._live = 0

    async def wait_for(self, target: int, *, timeout_s: float | None = None) -> int:
        if self._shutdown:
            await trio.lowlevel.checkpoint()
            raise SeqWaitShutdown(f"{self.what} waiter shut down")
        if self._current >= target:
            await trio.lowlevel.checkpoint()
            return self._current
        waiter = _Waiter()
        heapq.heappush(self._heap, (target, next(self._seq), waiter))
        self._live += 1
        try:
            if timeout_s is None:
                await waiter.event.wait()
            else:
                with trio.move_on_after(timeout_s):
                    await waiter.event.wait()
                if not waiter.event.is_set():
                    raise SeqWaitTimeout(target, self._current, timeout_s, self.what)
        finally:
            if waiter.live:  # cancelled or timed out: leave a tombstone
                waiter.live = False
                self._live -= 1
                if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
                    self._heap = [e for e in self._heap if e[2].live]
                    heapq.heapify(self._heap)
        if self._current < target:
            raise SeqWaitShutdown(f"{self.what} waiter shut down")
        return self._current
