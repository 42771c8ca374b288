"""The pipeline's two hand-offs: ``HandoffQueue`` (Reading -> Batching) and ``FoldChannel``
(Batching -> Execution, neon's ``spsc_fold``).

FoldChannel is a one-slot channel whose slot is a growing batch. The sender folds items into
the pending batch for as long as ``can_fold(batch, item)`` allows; when it refuses, the sender
parks until the receiver takes the batch, then the item starts the next one. That park is the
pipeline's backpressure: it stops the batcher, which stops the reader, which leaves bytes in the
socket. There is no timer anywhere: the receiver takes whatever has accumulated the moment it
is idle.

Why not a second memory channel: a batch handed over through a channel is sealed before the
receiver is free to act on it, so requests arriving meanwhile would wait one extra round.

Both are single-producer single-consumer, so each side has at most one parked task and a
``_Waiter`` (one task reference, woken with ``reschedule``) replaces trio's ``ParkingLot``
(an ordered dict of parked tasks and a list per wake-up): at queue depth 1 every request parks
and wakes each of these once, so their cost is the pipeline's cost over serial mode.

Checkpoint discipline (trio's, as its memory channels): every blocking call checks for
cancellation first, then either parks (its schedule point) or, when it did not need to park,
does a cancel-shielded checkpoint after the state change, so an operation either happened
completely or raised ``Cancelled`` having changed nothing. (``FoldChannel.receive`` on an
empty batch parks straight away: trio delivers a pending cancel when a task parks, so the
park is the check.) ``*_nowait`` calls never yield.
``HandoffQueue.receiver_idle`` tells the producer that the consumer is parked on an empty
queue, i.e. has nothing in hand: the producer may then do the consumer's next step itself
without reordering anything (the pipeline's Reading task folds directly when Batching is idle).
``FoldChannel.receiver_idle`` is the same for the consumer of batches: parked on an empty batch,
it has answered everything it took (the pipeline's fast lane relies on that).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class ReceiverGone(trio.BrokenResourceError):
    """The consumer of a hand-off stopped. A consequence, never a cause: the consumer stopped
    because it failed (or was cancelled), and that failure is the one to report."""


class _Waiter:
    """At most one parked task, woken by ``wake`` (or by cancellation)."""

    __slots__ = ("_abort_fn", "task")

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self._abort_fn = self._abort  # bound once, not per park

    async def park(self) -> None:
        self.task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_fn)

    def _abort(self, _: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def wake(self) -> None:
        task = self.task
        if task is not None:
            self.task = None
            trio.lowlevel.reschedule(task)


class _Ends:
    """What both hand-offs share: one parked task at most per side, and the two ways a side
    ends (the producer closes; the consumer goes away)."""

    __slots__ = ("_closed", "_receiver", "_receiver_gone", "_sender")

    def __init__(self) -> None:
        self._closed = False
        self._receiver_gone = False
        self._receiver = _Waiter()
        self._sender = _Waiter()

    def close(self) -> None:
        """No more items; the consumer gets what is pending, then ``EndOfChannel``."""
        self._closed = True
        self._receiver.wake()

    def close_receiver(self) -> None:
        """The consumer stops; a parked producer raises ``ReceiverGone``."""
        self._receiver_gone = True
        self._sender.wake()


class HandoffQueue(_Ends, Generic[T]):
    """Bounded FIFO, single producer, single consumer; ``close()`` (by the producer) ends it.

    ``capacity`` 0 still holds one item: the producer hands it over without waiting for the
    consumer to be parked (what matters here is bounding memory, not rendezvous).
    """

    __slots__ = ("_capacity", "_items")

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._capacity = max(1, capacity)
        self._items: deque[T] = deque()

    @property
    def receiver_idle(self) -> bool:
        """The consumer is parked on an empty queue (it holds nothing not yet passed on)."""
        return self._receiver.task is not None

    def put_nowait(self, item: T) -> bool:
        """Queue ``item`` if there is room (``False``, nothing done, if not)."""
        if self._closed:
            raise trio.ClosedResourceError("put on a closed HandoffQueue")
        if self._receiver_gone:
            raise ReceiverGone("HandoffQueue receiver is gone")
        if len(self._items) >= self._capacity:
            return False
        self._items.append(item)
        self._receiver.wake()
        return True

    async def put(self, item: T) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while not self.put_nowait(item):
            await self._sender.park()
            parked = True
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def get(self) -> T:
        """The oldest item, parking while the queue is empty; ``EndOfChannel`` once closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while not self._items:
            if self._closed:
                raise trio.EndOfChannel
            await self._receiver.park()
            parked = True
        item = self._items.popleft()
        self._sender.wake()
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return item


class FoldChannel(_Ends, Generic[T]):
    """Single producer, single consumer; ``close()`` (by the producer) ends the stream."""

    __slots__ = ("_batch", "_can_fold", "_fold_run")

    def __init__(
        self,
        can_fold: Callable[[list[T], T], bool],
        fold_run: Callable[[list[T], list[T], int], int] | None = None,
    ) -> None:
        super().__init__()
        self._can_fold = can_fold
        # fold_run(batch, items, start): append to ``batch`` the longest prefix of
        # ``items[start:]`` that ``can_fold`` would take one by one, return its length; a
        # caller's faster equivalent for runs of alike items (default: that loop).
        self._fold_run = fold_run if fold_run is not None else self._fold_one_by_one
        self._batch: list[T] = []

    def _fold_one_by_one(self, batch: list[T], items: list[T], start: int) -> int:
        can_fold, i, n = self._can_fold, start, len(items)
        while i < n and can_fold(batch, items[i]):
            batch.append(items[i])
            i += 1
        return i - start

    async def send(self, item: T) -> None:
        """Fold ``item`` into the pending batch, parking while the batch refuses it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise trio.ClosedResourceError("send on a closed FoldChannel")
        parked = False
        while self._batch and not self._can_fold(self._batch, item):
            if self._receiver_gone:
                raise ReceiverGone("FoldChannel receiver is gone")
            await self._sender.park()
            parked = True
        self._batch.append(item)
        self._receiver.wake()
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, item: T) -> bool:
        """Fold ``item`` if the pending batch takes it now; ``False`` (nothing done) if not."""
        if self._closed:
            raise trio.ClosedResourceError("send on a closed FoldChannel")
        if self._receiver_gone:
            raise ReceiverGone("FoldChannel receiver is gone")
        if self._batch and not self._can_fold(self._batch, item):
            return False
        self._batch.append(item)
        self._receiver.wake()
        return True

    def send_run_nowait(self, items: list[T], start: int) -> int:
        """``send_nowait`` of ``items[start:]`` in order until the first the pending batch
        refuses; how many it took (0: nothing done). One call for a run of requests."""
        if self._closed:
            raise trio.ClosedResourceError("send on a closed FoldChannel")
        if self._receiver_gone:
            raise ReceiverGone("FoldChannel receiver is gone")
        if start >= len(items):
            return 0
        batch = self._batch
        took = 0
        if not batch:
            batch.append(items[start])  # an empty batch takes anything
            took = 1
        took += self._fold_run(batch, items, start + took)
        if took:
            self._receiver.wake()
        return took

    async def receive(self) -> list[T]:
        """Take the whole pending batch, parking while it is empty."""
        if self._batch:
            await trio.lowlevel.checkpoint_if_cancelled()
            batch, self._batch = self._batch, []
            self._sender.wake()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return batch
        # Parking is this call's cancellation check and schedule point (trio delivers a
        # pending cancel the moment a task parks), so no separate check first: an idle
        # pipeline at queue depth 1 comes through here on every request.
        while not self._batch:
            if self._closed:
                await trio.lowlevel.checkpoint_if_cancelled()
                raise trio.EndOfChannel
            await self._receiver.park()
        batch, self._batch = self._batch, []
        self._sender.wake()
        return batch

    def pending(self) -> int:
        return len(self._batch)

    @property
    def receiver_idle(self) -> bool:
        """The consumer is parked on an empty batch: it holds nothing, so everything folded
        before has been taken *and* handled (it parks only between batches)."""
        return self._receiver.task is not None
