"""How a timeline's blocking WAL storage calls leave the event loop's thread (``wal_io_engine``).

Two engines, chosen per node (``SafekeeperConfig.wal_io_engine``):

- ``"writer-thread"`` (the default): one dedicated thread per timeline runs every call that
  changes the timeline's ``WalStorage`` (writes, truncations, the first segment's headers)
  strictly in submission order. ``submit`` hands a call over without waiting (a C-level
  ``queue.SimpleQueue.put``), so the ingest loop can receive the next write group while the
  previous one is being checked and written; ``Job.wait`` (or ``run``) waits for its
  result, which the thread delivers with one ``TrioToken.run_sync_soon``. The thread exits after
  ``IDLE_EXIT_S`` without work and is started again by the next call, so an idle timeline
  holds no thread and nothing needs closing.
- ``"threadpool"``: every call is its own ``trio.to_thread.run_sync`` (trio's thread cache),
  and ``submit`` waits for it (the job it returns is done): the ingest loop stops while a
  group is written. No two storage calls ever overlap either way.

The hand-off cost per call (measured with a no-op, round trip, at load ~5 on 2 cores):
``trio.to_thread.run_sync`` 80-120 µs of CPU, a persistent thread fed by ``SimpleQueue``
56-59 µs; the larger gain is that a submitted write no longer blocks the ingest loop.

Order is the contract: a job's call starts only after every earlier job's call returned, so
``WalStorage`` (not thread-safe) is only ever used by one thread at a time for changes,
record checks included (``write_group``). The event loop's thread itself only reads plain
attributes of it (and ``mark_flushed`` publishes a finished group's LSNs, under the
storage's ``lsn_lock``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import trio

__all__ = ["ENGINES", "IDLE_EXIT_S", "Job", "WalIo", "WalIoEngine"]

T = TypeVar("T")

WalIoEngine = Literal["writer-thread", "threadpool"]
ENGINES: tuple[WalIoEngine, ...] = ("writer-thread", "threadpool")

# A writer thread without work for this long exits (the next call starts a new one).
IDLE_EXIT_S = 10.0


def _capture(call: Callable[[], T]) -> tuple[bool, T | BaseException]:
    try:
        return True, call()
    except BaseException as exc:  # handed to the waiter, which raises it
        return False, exc


class Job(Generic[T]):
    """One submitted call; ``wait()`` returns its result or raises its exception.

    Waiting is not cancellable, as ``trio.to_thread.run_sync`` is not: the call runs to its
    end either way, and whoever submitted it must see what it did (the storage's LSNs)."""

    __slots__ = ("_done", "_result")

    def __init__(self) -> None:
        self._done = trio.Event()
        self._result: tuple[bool, T | BaseException] | None = None

    @classmethod
    def completed(cls, value: T) -> Job[T]:
        """A job that is already done with ``value`` (nothing to hand over)."""
        job: Job[T] = cls()
        job._finish((True, value))
        return job

    def _finish(self, result: tuple[bool, T | BaseException]) -> None:
        # On the event loop's thread (run_sync_soon).
        self._result = result
        self._done.set()

    @property
    def done(self) -> bool:
        return self._result is not None

    async def finished(self) -> None:
        """Wait (cancellably: nothing is taken) until the call has returned or raised."""
        if self._result is None:
            await self._done.wait()

    async def wait(self) -> T:
        if self._result is None:
            with trio.CancelScope(shield=True):
                await self._done.wait()
        assert self._result is not None
        ok, value = self._result
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value  # type: ignore[return-value]


class WalIo:
    """The WAL IO engine of one timeline (see the module docstring)."""

    __slots__ = ("_alive", "_lock", "_queue", "engine")

    def __init__(self, engine: WalIoEngine = "writer-thread") -> None:
        if engine not in ENGINES:
            raise ValueError(f"wal_io_engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.engine: WalIoEngine = engine
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Job[Any], trio.lowlevel.TrioToken]] = (
            queue.SimpleQueue()
        )
        # Guards the decision of an idle thread to exit against a submit that needs it.
        self._lock = threading.Lock()
        self._alive = False

    async def submit(self, fn: Callable[..., T], *args: Any) -> Job[T]:
        """Hand ``fn(*args)`` to the engine; its result comes from the returned job. The
        writer thread takes it without waiting (no checkpoint either); the threadpool
        engine runs it before returning."""
        job: Job[T] = Job()
        if self.engine == "threadpool":
            with trio.CancelScope(shield=True):
                job._finish(await trio.to_thread.run_sync(_capture, lambda: fn(*args)))
            return job
        token = trio.lowlevel.current_trio_token()
        with self._lock:
            self._queue.put((lambda: fn(*args), job, token))
            if not self._alive:
                self._alive = True
                threading.Thread(target=self._serve, name="wal-writer", daemon=True).start()
        return job

    def has_thread(self) -> bool:
        """Whether a writer thread is running (it exits when idle)."""
        return self._alive

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``submit`` and wait: ``fn(*args)`` after every call submitted before it."""
        return await (await self.submit(fn, *args)).wait()

    def _serve(self) -> None:
        get = self._queue.get
        while True:
            try:
                call, job, token = get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._alive = False
                        return
                continue
            result = _capture(call)
            try:
                token.run_sync_soon(job._finish, result)
            except trio.RunFinishedError:
                # The event loop is gone (node shutdown): nobody waits for this result.
                pass
            # Not kept while waiting for the next job: the call's arguments pin the write
            # group's receive memory.
            del call, job, token, result
