"""FoldChannel: a one-slot channel whose slot is a growing batch (neon's ``spsc_fold``).

The sender folds items into the pending batch for as long as ``can_fold(batch, item)`` allows;
when it refuses, the sender parks until the receiver takes the batch, then the item starts the
next one. That park is the pipeline's backpressure: it stops the batcher, which stops the
reader, which leaves bytes in the socket. There is no timer anywhere: the receiver takes
whatever has accumulated the moment it is idle.

Why not a second memory channel: a batch handed over through a channel is sealed before the
receiver is free to act on it, so requests arriving meanwhile would wait one extra round.

Both ``send`` and ``receive`` follow trio's channel checkpoint discipline: a cancellation
check first, then either parking or (when no parking was needed) a cancel-shielded checkpoint
after the state change, so an operation either happened completely or raised ``Cancelled``
having changed nothing, and every call is a schedule point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class FoldChannel(Generic[T]):
    """Single producer, single consumer; ``close()`` (by the producer) ends the stream."""

    __slots__ = ("_batch", "_can_fold", "_closed", "_lot", "_receiver_gone")

    def __init__(self, can_fold: Callable[[list[T], T], bool]) -> None:
        self._can_fold = can_fold
        self._batch: list[T] = []
        self._closed = False
        self._receiver_gone = False
        self._lot = trio.lowlevel.ParkingLot()

    async def send(self, item: T) -> None:
        """Fold ``item`` into the pending batch, parking while the batch refuses it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise trio.ClosedResourceError("send on a closed FoldChannel")
        parked = False
        while self._batch and not self._can_fold(self._batch, item):
            if self._receiver_gone:
                raise trio.BrokenResourceError("FoldChannel receiver is gone")
            await self._lot.park()
            parked = True
        self._batch.append(item)
        self._lot.unpark_all()
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, item: T) -> bool:
        """Fold ``item`` if the pending batch takes it now; ``False`` (nothing done) if not."""
        if self._closed:
            raise trio.ClosedResourceError("send on a closed FoldChannel")
        if self._receiver_gone:
            raise trio.BrokenResourceError("FoldChannel receiver is gone")
        if self._batch and not self._can_fold(self._batch, item):
            return False
        self._batch.append(item)
        self._lot.unpark_all()
        return True

    def close(self) -> None:
        """No more items; the receiver gets the last batch, then ``EndOfChannel``."""
        self._closed = True
        self._lot.unpark_all()

    def close_receiver(self) -> None:
        """The receiver stops; a parked sender raises ``BrokenResourceError``."""
        self._receiver_gone = True
        self._lot.unpark_all()

    async def receive(self) -> list[T]:
        """Take the whole pending batch, parking while it is empty."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while not self._batch:
            if self._closed:
                raise trio.EndOfChannel
            await self._lot.park()
            parked = True
        batch, self._batch = self._batch, []
        self._lot.unpark_all()
        if not parked:
            # Parking already was this call's schedule point (as in trio's channels); a second
            # one would cost an event-loop round per batch, which an idle pipeline at queue
            # depth 1 pays on every request.
            await trio.lowlevel.cancel_shielded_checkpoint()
        return batch

    def pending(self) -> int:
        return len(self._batch)
