"""A timeline: one branch of a tenant's history, its layers, its LSNs and its reads.

Public interface (stable; other rooms build on it):

- writes (WAL ingest): ``await put(key, lsn, value)`` for every value of a record, then
  ``finish_write(lsn)`` once the record is complete. LSNs never go backwards; puts at one LSN
  must all come before ``finish_write`` of it. The WAL ingest's cheaper forms of ``put``:
  ``put_encoded`` (a value already encoded), ``put_nowait`` / ``put_mixed_nowait`` (no await:
  store what fits in the write buffer now, say how much; the caller ``put_encoded``-s the rest).
- LSNs: ``last_record_lsn`` (advanced by ``finish_write``), ``await wait_lsn(lsn, timeout_s)``,
  ``disk_consistent_lsn`` (everything at or below it is in layer files listed in
  ``index_part.json``), ``latest_gc_cutoff_lsn`` (reads below it are refused).
- reads: ``await get(key, lsn) -> bytes``; ``await get_vectored(keys, lsn) -> dict[Key, bytes]``;
  ``await get_vectored_results(keys, lsn) -> dict[Key, bytes | PageReconstructError]`` (per-key
  errors); ``await get_pages([(key, lsn), ...]) -> list[bytes | PageReconstructError]`` (one walk
  for the whole batch, each key at its own LSN, for the page service; ``get_pages_per_lsn`` is
  the old one-walk-per-LSN way); ``get_rel_size`` / ``get_rel_exists``.
- maintenance: ``freeze()`` (at a record boundary only, else ``PartialRecordError``), ``flush()`` (freeze + write L0s + index_part), ``compact()``
  (L0 -> L1, then image layers), ``gc(retain_lsns)`` (normally via ``Tenant.gc``).

Reads: ``get_impl`` picks the vectored walk or the legacy per-key path (``read_path``); with
``validate_get`` both run (the second one without the materialized page cache, so it is an
independent oracle) and any difference in bytes or error kind raises ``GetValidationError``,
bumps ``pageserver_get_validation_mismatches_total`` and logs the diff.

Branches: a timeline may have an ancestor and ``ancestor_lsn``; reads at or below it fall
through to the ancestor (``read_path``).

Concurrency: two locks, always taken in this order. The background lock serializes the
structural background work of one timeline (compaction, image creation, GC) among itself: GC
must not remove layers a compaction is reading, nor two compactions take the same L0s. The
layers lock (``_layers_lock``) guards every change of the layer map and every index_part
write (they share one temp file name): flush holds it to write an L0 and list it, GC for its
whole (cheap) round, so a branch created meanwhile is either counted or refused; compaction
and image creation only for their swap (``storage/compaction.py``), so the WAL ingest's roll,
which needs it, never waits for a compaction's reading and writing. Readers don't lock, and
layers replaced while a read may still hold them are closed and deleted only when no read is
in progress (``LayerGraveyard``). ``shutdown`` cancels a running background round and waits
for it to unwind before closing the layers.

The L0 writer (``l0_writer``): with ``"process"``, a layer of at least ``l0_writer_min_bytes``
is written by the timeline's worker process (``storage/l0_worker.py``), off the WAL ingest's
core; the writer's roll freezes the layer and hands it to a background flush task, which holds
the layers lock while the worker writes and then publishes the L0 exactly as an inline flush
does (index_part first, then layer map and ``disk_consistent_lsn``); the next roll waits for
it (one rolled layer in flight). ``flush`` (and so checkpoint and shutdown's flush) waits for a
background flush and returns with every frozen layer durable. ``shutdown`` cancels a background
flush (the worker is killed) and stops the worker.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog
import trio
from prometheus_client import Counter

from pageserver.remote_timeline import Pins, RemoteTimelineClient
from pageserver.storage import read_path
from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import (
    EvictedReader,
    LayerNotResidentError,
    PersistentLayer,
    ReadContext,
)
from pageserver.storage.ephemeral_file import EphemeralFile
from pageserver.storage.index_part import IndexPart, write_index_part
from pageserver.storage.inmemory_layer import InMemoryLayer, PutItem
from pageserver.storage.io_engine import IoEngine
from pageserver.storage.key import KEY_MAX, Key, KeyRange, KeySpace, key_hex, key_next, rel_size_key
from pageserver.storage.l0_worker import L0Worker
from pageserver.storage.layer_file import (
    IndexBlockCache,
    LayerClosedError,
    LayerFileReader,
    WriteOptions,
)
from pageserver.storage.layer_map import LayerMap
from pageserver.storage.page_cache import PageCache
from pageserver.storage.reconstruct import (
    KeyState,
    MissingKeyError,
    PageReconstructError,
    RedoManager,
    reconstruct_value,
)
from pageserver.storage.value import Value, encode_value
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn, format_lsn

if TYPE_CHECKING:
    from pageserver.storage.read_path import ReadableTimeline

log = structlog.get_logger(__name__)

GET_VALIDATION_MISMATCHES = Counter(
    "pageserver_get_validation_mismatches",
    "reads where the vectored and the legacy path disagreed (validate_get)",
)
# keys reconstructed between two yields to the event loop (_read_requests)
RECONSTRUCT_YIELD_EVERY = 16
LAYER_DOWNLOADS = Counter("pageserver_layer_downloads", "layer files downloaded on demand from remote storage")
LAYER_DOWNLOAD_FAILURES = Counter("pageserver_layer_download_failures", "on-demand layer downloads that failed")
LAYER_EVICTIONS = Counter("pageserver_layer_evictions", "local layer files evicted (kept in remote storage)")
# A read that finds a layer evicted under its walk (one that appeared after it pinned its
# layers) starts over this many times in all.
READ_ATTEMPTS = 3
BACKGROUND_FLUSH_FAILURES = Counter(
    "pageserver_background_flush_failures",
    "background L0 flushes of a rolled layer that failed (the frozen layer stays for the next flush)",
)

Result = bytes | PageReconstructError


class GetValidationError(AssertionError):
    """``validate_get`` found the two read paths disagreeing: a bug, never a user error."""


class LsnTimeoutError(TimeoutError):
    pass


class PartialRecordError(Exception):
    """``freeze`` while a record is partly put: a layer must not end inside a record."""


class TimelineShutdownError(Exception):
    """The timeline was shut down before or while the read ran: its layers are closed."""


class LsnBelowGcCutoffError(PageReconstructError):
    pass


class LayerDownloadError(PageReconstructError):
    """A layer the read needs is not on local disk and could not be downloaded."""


class LayerGraveyard:
    """Defers closing and deleting replaced layers until no read is in progress (per tenant)."""

    def __init__(self, *, per_layer: bool = False) -> None:
        self.readers = 0
        # A tenant that evicts (``max_local_layer_bytes``): every read pins the layers it may
        # visit (``PersistentLayer.readers``), and a layer no read in progress pins can be
        # evicted while other reads go on. Otherwise evictions wait, like deletions of replaced
        # layers, for a moment with no read in progress (which constant reads never give).
        self.per_layer = per_layer
        self._dead: list[PersistentLayer | InMemoryLayer] = []
        # Layer files an upload queue still has to upload (``remote_timeline``): kept until then.
        self.pins: Pins = Pins()
        # Layers of the tenant whose file is in remote storage only: while 0, reads skip
        # looking for layers to download.
        self.evicted = 0
        # Evictions asked for, done at the next moment no read is in progress (``collect``).
        self._evictions: list[tuple[Timeline, PersistentLayer]] = []

    def request_eviction(self, timeline: Timeline, layer: PersistentLayer) -> None:
        self._evictions.append((timeline, layer))

    def bury(self, layers: Iterable[PersistentLayer | InMemoryLayer]) -> None:
        self._dead.extend(layers)

    async def collect(self) -> None:
        if self._evictions and (self.per_layer or not self.readers):
            # Swapped out with no await between the readers check and the swaps: a read that
            # starts later finds the layers evicted and downloads them (after the unlink).
            # (Per layer: ``begin_eviction`` refuses a layer a read in progress pinned.)
            todo, self._evictions = self._evictions, []
            begun = [(tl, x, r) for tl, x in todo if (r := tl.begin_eviction(x)) is not None]
            for tl, x, r in begun:
                await tl.finish_eviction(x, r)
        if self.readers or not self._dead:
            return
        dead, self._dead = self._dead, []
        pinned: list[PersistentLayer | InMemoryLayer] = [
            x for x in dead if isinstance(x, PersistentLayer) and x.path in self.pins
        ]
        if pinned:
            self._dead = pinned
            dead = [x for x in dead if not (isinstance(x, PersistentLayer) and x.path in self.pins)]
        for layer in dead:
            if isinstance(layer, PersistentLayer) and not layer.resident:
                self.evicted -= 1  # no local file to delete
                continue
            await layer.aclose()
            if isinstance(layer, PersistentLayer):
                # Unlinking a large layer file can block: the engine's way, like its reads.
                await layer.reader.file.engine.unlink(layer.path)


def _describe(result: Result) -> str:
    if isinstance(result, bytes):
        return f"{len(result)} bytes {result[:48]!r}"
    return f"{type(result).__name__}: {result}"


def _same(a: Result, b: Result) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    return type(a) is type(b)


class Timeline:
    def __init__(
        self,
        *,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        path: Path,
        config: StorageConfig,
        engine: IoEngine,
        redo: RedoManager,
        page_cache: PageCache,
        index_cache: IndexBlockCache,
        graveyard: LayerGraveyard,
        ancestor: Timeline | None = None,
        ancestor_lsn: Lsn = INVALID_LSN,
        start_lsn: Lsn = INVALID_LSN,
        nursery: trio.Nursery | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.timeline_id = timeline_id
        self.path = path
        self.config = config
        self.engine = engine
        self.redo = redo
        self.page_cache = page_cache
        self.index_cache = index_cache
        self.graveyard = graveyard
        self.ancestor = ancestor
        self._ancestor_lsn = ancestor_lsn
        self.nursery = nursery
        self._layer_map = LayerMap()
        self.open_layer: InMemoryLayer | None = None
        self.frozen_layers: list[InMemoryLayer] = []  # oldest first
        self._last_record_lsn = start_lsn
        self.disk_consistent_lsn = start_lsn
        self.latest_gc_cutoff_lsn = INVALID_LSN
        self._next_layer_start = Lsn(start_lsn + 1)
        self._max_put_lsn = start_lsn
        self._waiters: list[tuple[int, int, trio.Event]] = []
        self._waiter_seq = 0
        self._layers_lock: trio.Lock | None = None
        self._put_lock_obj: trio.Lock | None = None
        self._background_lock_obj: trio.Lock | None = None
        self._background_scope: trio.CancelScope | None = None
        self._shut_down = False
        self._layers_closed = False  # by shutdown: the layer map is empty from then on
        # LSN -> number of reads in flight at it: GC keeps its cutoff at or below the lowest
        # (a read admitted above the old cutoff must find every layer it needs)
        self._reads_in_flight: dict[int, int] = {}
        # Test seam: awaited at named points of a compaction round ("l0_merge", "image", "swap")
        self.compaction_hook: Callable[[str], Awaitable[None]] | None = None
        # (monotonic time, lsn) samples for pitr_interval: at most one per second
        self._lsn_times: list[tuple[float, Lsn]] = []
        self.last_image_check_lsn = INVALID_LSN
        self._key = timeline_id.raw
        # The L0 writer process (``l0_writer = "process"``): started on its first job, stopped
        # by ``shutdown``. Tests may replace it (before its first job) with one that has fault flags.
        self.l0_worker = L0Worker()
        # The writer's roll hands the frozen layer to a background flush (its scope, its end)
        self._background_flush: tuple[trio.CancelScope, trio.Event] | None = None
        self.background_flush_failures = 0
        # The upload queue to remote storage (None: the node has none); every index_part
        # written here is handed to it.
        self.remote: RemoteTimelineClient | None = None
        # Pages answered by the image kernel (``_read_images``) rather than the general walk.
        self.image_fast_pages = 0

    # Whether reads try the image kernel first (tests turn it off to compare with the walk).
    image_fast_path = True

    # -- ReadableTimeline ------------------------------------------------------------------

    @property
    def layer_map(self) -> LayerMap:
        return self._layer_map

    @property
    def ancestor_timeline(self) -> ReadableTimeline | None:
        return self.ancestor

    @property
    def ancestor_lsn(self) -> Lsn:
        return self._ancestor_lsn

    def in_memory_layers(self) -> Sequence[InMemoryLayer]:
        """Open layer first, then frozen layers newest first."""
        open_layer = self.open_layer
        if not self.frozen_layers:
            return () if open_layer is None else (open_layer,)
        layers = self.frozen_layers[::-1]
        if open_layer is not None:
            layers.insert(0, open_layer)
        return layers

    # -- LSNs ------------------------------------------------------------------------------

    @property
    def last_record_lsn(self) -> Lsn:
        return self._last_record_lsn

    def finish_write(self, lsn: Lsn) -> None:
        """Every value of the record ending at ``lsn`` has been put: readers may see it."""
        if lsn < self._last_record_lsn:
            raise ValueError(
                f"finish_write({format_lsn(lsn)}) below last_record_lsn {format_lsn(self._last_record_lsn)}"
            )
        self._last_record_lsn = lsn
        now = time.monotonic()
        if not self._lsn_times or now - self._lsn_times[-1][0] >= 1.0:
            self._lsn_times.append((now, lsn))
        while self._waiters and self._waiters[0][0] <= lsn:
            heapq.heappop(self._waiters)[2].set()

    async def wait_lsn(self, lsn: Lsn, timeout_s: float | None = None) -> None:
        """Return once ``last_record_lsn >= lsn``; ``LsnTimeoutError`` after ``timeout_s``
        (default ``wait_lsn_timeout_s``)."""
        if self._last_record_lsn >= lsn:
            return
        event = trio.Event()
        self._waiter_seq += 1
        entry = (lsn, self._waiter_seq, event)
        heapq.heappush(self._waiters, entry)
        timeout = self.config.wait_lsn_timeout_s if timeout_s is None else timeout_s
        try:
            with trio.move_on_after(timeout):
                await event.wait()
                return
        finally:
            if not event.is_set():
                # timed out or cancelled: a waiter for an LSN that never comes would
                # otherwise stay in the heap for the timeline's life
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
        raise LsnTimeoutError(
            f"timed out after {timeout}s waiting for WAL up to {format_lsn(lsn)}; "
            f"last_record_lsn is {format_lsn(self._last_record_lsn)}"
        )

    # -- writes ----------------------------------------------------------------------------

    @property
    def _lock(self) -> trio.Lock:
        if self._layers_lock is None:
            self._layers_lock = trio.Lock()
        return self._layers_lock

    @property
    def layers_lock(self) -> trio.Lock:
        """The layers lock, for compaction's swap (see the module docstring)."""
        return self._lock

    @property
    def _background_lock(self) -> trio.Lock:
        if self._background_lock_obj is None:
            self._background_lock_obj = trio.Lock()
        return self._background_lock_obj

    @property
    def _put_lock(self) -> trio.Lock:
        if self._put_lock_obj is None:
            self._put_lock_obj = trio.Lock()
        return self._put_lock_obj

    async def put(self, key: Key, lsn: Lsn, value: Value) -> None:
        """Store ``value`` at (key, lsn). ``lsn`` must be above ``last_record_lsn``."""
        if lsn <= self._last_record_lsn or lsn < self._max_put_lsn or lsn < self._next_layer_start:
            raise ValueError(
                f"put at {format_lsn(lsn)} is not above last_record_lsn "
                f"{format_lsn(self._last_record_lsn)} / earlier puts"
            )
        await self.put_encoded(key, lsn, encode_value(value), value.will_init)

    async def put_encoded(self, key: Key, lsn: Lsn, blob: bytes, will_init: bool) -> None:
        """``put`` of a value already encoded (``encode_value``)."""
        if lsn <= self._last_record_lsn or lsn < self._max_put_lsn or lsn < self._next_layer_start:
            raise ValueError(
                f"put at {format_lsn(lsn)} is not above last_record_lsn "
                f"{format_lsn(self._last_record_lsn)} / earlier puts"
            )
        if self.put_nowait(key, lsn, blob, will_init):
            return
        layer = self.open_layer
        if layer is not None and lsn > self._max_put_lsn and self._should_roll(layer, lsn, len(blob)):
            # The writer itself, between two records (``lsn`` is above every put): no wait.
            await self._flush()
        # A put's append and index update must not interleave with a freeze (the background
        # flush): the put lock keeps them apart; uncontended, it costs no checkpoint.
        lock = self._put_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            layer = self.open_layer
            if layer is None:
                layer = await self._open_new_layer()
            self._max_put_lsn = lsn
            await layer.put(key, lsn, blob, will_init)
        finally:
            lock.release()

    def put_nowait(self, key: Key, lsn: Lsn, blob: bytes, will_init: bool) -> bool:
        """Store an encoded value (``encode_value``) at (key, lsn) without an await when
        nothing stands in the way: an open layer with room in its write buffer, no roll due,
        no put or freeze holding the put lock. ``False``: nothing was stored, call ``put``
        (which also raises the errors). The WAL ingest's hot path: a put without the lock
        and coroutine layers costs about half as much."""
        room = self._nowait_room(lsn, lsn)
        if room is None:
            return False
        layer, max_size = room
        # No await from here on: a freeze cannot come between the append and the index entry.
        if not layer.try_put(key, lsn, blob, will_init, max_size):
            return False
        self._max_put_lsn = lsn
        return True

    def put_mixed_nowait(
        self, items: Sequence[PutItem], start: int = 0, sub: int = 0
    ) -> tuple[int, int]:
        """``put_nowait`` of ``items`` (in LSN order, a record's values together) while they fit
        in the write buffer: single values ``(key, lsn, encoded value, will_init)`` and runs of
        values of one key (``InMemoryLayer.try_put_mixed``: the fused WAL ingest's runs of like
        records), from value ``sub`` of ``items[start]`` on, with the same tests (LSNs, open
        layer, put lock, roll): one buffer append and no call per value. Returns ``(i, v)``,
        the first value not stored (value ``v`` of ``items[i]``), which the caller stores with
        ``put_encoded`` (which rolls the layer or waits for the buffer, and raises the errors)
        before it continues here."""
        n = len(items)
        if start >= n:
            return start, sub
        item = items[start]
        if len(item) != 4 and not item[1]:
            raise ValueError("a run of no values")
        lsn = item[1] if len(item) == 4 else item[1][sub]
        item = items[-1]
        room = self._nowait_room(lsn, item[1] if len(item) == 4 else item[1][-1])
        if room is None:
            return start, sub
        layer, max_size = room
        i, v = layer.try_put_mixed(items, start, sub, max_size)
        if (i, v) != (start, sub):
            item = items[i - 1] if v == 0 else items[i]
            self._max_put_lsn = Lsn(item[1] if len(item) == 4 else item[1][v - 1])
        return i, v

    def _nowait_room(self, first: int, last: int) -> tuple[InMemoryLayer, int] | None:
        """The open layer and the size it may grow to for puts without an await of values at
        LSNs ``first`` .. ``last``; ``None`` when such puts must not be made (an LSN not above
        what was put, no open layer, the put lock taken, a roll due at ``last``): then
        ``put_encoded`` stores the value (rolling, waiting, or raising the error). When a roll
        is due somewhere before ``last``, put_encoded finds where, value by value (once per
        layer). The size test of ``_should_roll`` is left to the layer's ``try_put*``."""
        if first <= self._last_record_lsn or first < self._max_put_lsn or first < self._next_layer_start:
            return None
        layer = self.open_layer
        lock = self._put_lock_obj
        if layer is None or (lock is not None and lock.locked()):
            return None
        if last <= self._max_put_lsn:
            return layer, 1 << 62  # (no new LSN: within the record that was let in)
        if self._roll_due(layer, last):
            return None
        return layer, self.config.checkpoint_distance

    def _roll_due(self, layer: InMemoryLayer, lsn: int) -> bool:
        cfg = self.config
        return (
            lsn - layer.start_lsn >= cfg.checkpoint_distance
            or time.monotonic() - layer.opened_at >= cfg.checkpoint_timeout_s
        )

    def _should_roll(self, layer: InMemoryLayer, lsn: Lsn, size: int) -> bool:
        return layer.size + size > self.config.checkpoint_distance or self._roll_due(layer, lsn)

    async def _open_new_layer(self) -> InMemoryLayer:
        cfg = self.config
        file = await EphemeralFile.create(
            self.engine,
            self.path,
            nursery=self.nursery,
            write_buffer_size=cfg.write_buffer_size,
            double_buffering=cfg.double_buffering,
        )
        self.open_layer = InMemoryLayer(file, self._next_layer_start)
        return self.open_layer

    async def freeze(self) -> None:
        """Close the open layer at ``last_record_lsn + 1``; no-op if empty.

        Only at a record boundary: with a record partly put (a put above ``last_record_lsn``,
        not yet finished with ``finish_write``) it raises ``PartialRecordError`` and changes
        nothing. Freezing there would end the layer inside the record: its remaining values
        would be refused (below the next layer's start) and a flush would make the half
        record durable. ``flush`` waits for the record instead; the writer's own roll
        (``put_encoded``) freezes between two records."""
        if not await self._freeze(whole_records=True):
            raise PartialRecordError(
                f"not freezing: the record at {format_lsn(self._max_put_lsn)} is only partly put "
                f"(last_record_lsn {format_lsn(self._last_record_lsn)})"
            )

    async def _freeze(self, *, whole_records: bool) -> bool:
        """``freeze``; with ``whole_records``, nothing (``False``) while a record is partly put."""
        async with self._put_lock:
            if whole_records and self._max_put_lsn > self._last_record_lsn:
                return False
            layer = self.open_layer
            if layer is None or not layer.index:
                return True
            end = Lsn(max(self._max_put_lsn, self._last_record_lsn) + 1)
            # Move it to the frozen list before the first await: a read running meanwhile
            # must find the layer in one of the two places.
            layer.end_lsn = end
            self.frozen_layers.append(layer)
            self.open_layer = None
            self._next_layer_start = end
            await layer.freeze(end)
            return True

    async def flush_if_old(self) -> None:
        """Flush an open layer that has waited ``checkpoint_timeout_s`` (no put came to roll it).
        Not while a record is partly put: the background job would hold the layers lock while
        ``flush`` waits for it (or fail after ``wait_lsn_timeout_s`` if its writer gave up);
        the next period tries again, and a writer that goes on rolls the layer itself."""
        layer = self.open_layer
        if (
            self._max_put_lsn <= self._last_record_lsn
            and layer is not None
            and layer.index
            and time.monotonic() - layer.opened_at >= self.config.checkpoint_timeout_s
        ):
            await self.flush()

    async def flush(self) -> None:
        """Freeze, then write every frozen layer to an L0 file and record it in index_part.

        Called from outside the writer (background ``flush_if_old``, the HTTP checkpoint,
        shutdown), it first waits for the record being put to be finished: freezing part of a
        record would end the layer at that record's LSN, refuse the writer's next value of it
        and, once durable, have a restart skip the record with values missing. A record the
        writer abandoned (failed, cancelled) is never finished: then ``LsnTimeoutError`` after
        ``wait_lsn_timeout_s``, and ``disk_consistent_lsn`` stays below it (re-ingested whole).
        A background flush of a rolled layer holds the layers lock: this waits for it, then
        writes whatever is still frozen (a layer it failed on too), so every layer frozen
        before the call is durable when it returns.
        """
        async with self._lock:
            # The writer needs ``_lock`` only to roll, between two records: no deadlock.
            while not await self._freeze(whole_records=True):
                partial = self._max_put_lsn
                try:
                    await self.wait_lsn(partial)
                except LsnTimeoutError:
                    raise LsnTimeoutError(
                        f"not flushing: the record at {format_lsn(partial)} is only partly put "
                        f"(last_record_lsn {format_lsn(self._last_record_lsn)})"
                    ) from None
            await self._write_frozen()

    async def _flush(self) -> None:
        """The writer's roll (``put_encoded``): it is between two records (the put that rolls
        is above every earlier put, so each record put so far is whole, finished or not).

        With the process L0 writer the frozen layer's L0 is written in the background (the
        writer goes on into a new open layer; readers read the frozen layer meanwhile). The
        background flush holds the layers lock while it writes, so the next roll waits here
        for it: at most one rolled layer is in flight (bounded memory and disk). A layer left
        frozen by a failed background flush is written by the roll itself, before anything
        newer, and its error then reaches the writer as an inline failure would."""
        async with self._lock:
            await self._freeze(whole_records=False)
            started = self._start_background_flush()
            if started is None:
                await self._write_frozen()
                return
        # The task takes the layers lock as soon as the roll lets it go; the writer waits for
        # that (a few µs) so the flush runs now even if the writer does not yield for long.
        await started.wait()

    async def wait_background_flush(self) -> None:
        """Return once no background flush of a rolled layer is running (it may have failed:
        then the layer is still in ``frozen_layers``; ``flush`` writes it)."""
        while self._background_flush is not None:
            await self._background_flush[1].wait()

    def _start_background_flush(self) -> trio.Event | None:
        """Hand the one frozen layer to ``_run_background_flush`` if the config says so;
        ``None`` if not (caller holds the layers lock, which the task takes when the caller
        lets it go: the returned event is set once it holds it)."""
        frozen = self.frozen_layers
        cfg = self.config
        if (
            cfg.l0_writer != "process"
            or self.nursery is None
            or self._shut_down
            or len(frozen) != 1
            or frozen[0].size < cfg.l0_writer_min_bytes
        ):
            return None
        scope, started, done = trio.CancelScope(), trio.Event(), trio.Event()
        try:
            self.nursery.start_soon(self._run_background_flush, scope, started, done, name="timeline.l0_flush")
        except RuntimeError:
            return None  # the nursery is closing: the roll writes it itself
        self._background_flush = (scope, done)
        return started

    async def _run_background_flush(self, scope: trio.CancelScope, started: trio.Event, done: trio.Event) -> None:
        """Write the rolled layer's L0 and publish it, as ``flush`` does. A failure leaves the
        frozen layer in place (nothing advanced) for the next roll or flush; it is logged and
        counted, not raised into the tenant's nursery. ``shutdown`` cancels it."""
        try:
            with scope:
                async with self._lock:
                    started.set()
                    if not self._layers_closed:
                        await self._write_frozen()
        except Exception:
            self.background_flush_failures += 1
            BACKGROUND_FLUSH_FAILURES.inc()
            log.error(
                "background L0 flush failed; the frozen layer stays for the next flush",
                tenant_id=self.tenant_id.hex,
                timeline_id=self.timeline_id.hex,
                exc_info=True,
            )
        finally:
            if self._background_flush is not None and self._background_flush[1] is done:
                self._background_flush = None
            started.set()
            done.set()

    async def _write_l0(self, layer: InMemoryLayer) -> Path | None:
        """``layer``'s L0 file, written as the config says (``l0_writer``)."""
        cfg = self.config
        if cfg.l0_writer == "inline" or layer.size < cfg.l0_writer_min_bytes:
            return await layer.write_l0(self.engine, self.path, self.write_options())
        if not layer.file.writer.closed:
            # A ``freeze`` in another task is still writing the layer's tail; it holds the put
            # lock until it is done (the worker reads the tail from the file).
            async with self._put_lock:
                pass
            if not layer.file.writer.closed:
                raise OSError(
                    errno.EIO, f"{layer}: its tail was not written to {layer.file.path} (the freeze failed)"
                )
        self._raise_if_layers_closed()
        return await self.l0_worker.write_l0(
            layer, self.path, buffer_size=cfg.write_buffer_size, write_sync_mode=self.engine.write_sync_mode,
            stage=None if self.remote is None else self.remote.stage_spec(),
        )

    async def _write_frozen(self) -> None:
        """Write every frozen layer to an L0 file and record it (caller holds ``_lock``)."""
        while self.frozen_layers:
            layer = self.frozen_layers[0]
            assert layer.end_lsn is not None
            path = await self._write_l0(layer)
            added: list[PersistentLayer] = []
            if path is not None:
                added.append(await PersistentLayer.open(self.engine, path, self.index_cache))
            consistent = Lsn(layer.end_lsn - 1)
            # index_part first, the in-memory state only once it is durable: the WAL receiver
            # tells the safekeepers ``disk_consistent_lsn``, and they may then forget the WAL
            # below it. Meanwhile readers find the values in the frozen layer.
            try:
                await self.write_index_part(add=added, disk_consistent_lsn=consistent)
                # (durable now; but a shutdown meanwhile closed the layers and emptied the map)
                self._raise_if_layers_closed()
            except BaseException:
                # Nothing changed; the frozen layer stays for the next flush (which rewrites
                # the same L0). The file stays too: a write that failed after its rename (at
                # the directory fsync) left an index_part naming it; the next load settles it.
                with trio.CancelScope(shield=True):
                    for x in added:
                        await x.aclose()
                raise
            self._layer_map.replace([], added)
            self.frozen_layers.pop(0)
            self.disk_consistent_lsn = consistent
            self.graveyard.bury([layer])
        await self.graveyard.collect()

    def write_options(self) -> WriteOptions:
        return WriteOptions(
            buffer_size=self.config.write_buffer_size,
            double_buffering=self.config.double_buffering,
            nursery=self.nursery,
        )

    async def write_index_part(
        self,
        *,
        remove: Sequence[PersistentLayer] = (),
        add: Sequence[PersistentLayer] = (),
        disk_consistent_lsn: Lsn | None = None,
    ) -> None:
        """Write index_part for the layer map with ``remove`` taken out and ``add`` put in
        (and ``disk_consistent_lsn`` if given), without changing either: callers swap their
        change in only once this returned (caller holds the layers lock).

        Never once ``shutdown`` closed the layers: that empties the layer map, so an index_part
        written then (by a flush already running in another task) would list none of the
        layers and the next load would delete them all as unlisted."""
        self._raise_if_layers_closed()
        part = self.index_part(remove, add, disk_consistent_lsn)
        await write_index_part(self.engine, self.path, part)
        if self.remote is not None:
            # Durable locally: the remote gets the same list, its layers first.
            self.remote.schedule_index_upload(part)

    @property
    def remote_consistent_lsn(self) -> Lsn:
        """What is durable in remote storage (what the safekeepers may forget WAL below);
        ``disk_consistent_lsn`` for a node without remote storage."""
        if self.remote is None:
            return self.disk_consistent_lsn
        return self.remote.remote_consistent_lsn

    async def write_index_part_locked(self) -> None:
        """``write_index_part`` under the layers lock, as flush, compaction and GC write it
        (they share one temp file name): for a writer that does not hold the lock."""
        async with self._lock:
            await self.write_index_part()

    def index_part(
        self,
        remove: Sequence[PersistentLayer] = (),
        add: Sequence[PersistentLayer] = (),
        disk_consistent_lsn: Lsn | None = None,
    ) -> IndexPart:
        layers = {x.path.name: x.file_size for x in self._layer_map}
        for x in remove:
            del layers[x.path.name]
        for x in add:
            layers[x.path.name] = x.file_size
        return IndexPart(
            layers=layers,
            disk_consistent_lsn=self.disk_consistent_lsn if disk_consistent_lsn is None else disk_consistent_lsn,
            latest_gc_cutoff_lsn=self.latest_gc_cutoff_lsn,
            ancestor_timeline_id=None if self.ancestor is None else self.ancestor.timeline_id.hex,
            ancestor_lsn=self._ancestor_lsn,
        )

    # -- maintenance -----------------------------------------------------------------------

    async def compact(self, *, force_image: bool = False) -> None:
        """L0 -> L1 when ``compaction_threshold`` L0s wait, then image layers where the delta
        stack reaches ``image_creation_threshold`` (every partition if ``force_image``).
        Under the background lock only: ingest and flushes go on meanwhile."""
        from pageserver.storage.compaction import compact_level0, create_image_layers

        async with self._background_lock:
            if self._shut_down:
                return
            with self._background_round():
                if self.graveyard.evicted:
                    await self.ensure_resident([(self, x) for x in self._layer_map.l0_layers() if not x.resident])
                await compact_level0(self)
                await create_image_layers(self, force=force_image)
        await self.graveyard.collect()

    @contextlib.contextmanager
    def _background_round(self) -> Iterator[None]:
        """A round ``shutdown`` can cancel (it then ends quietly, having changed nothing)."""
        with trio.CancelScope() as scope:
            self._background_scope = scope
            try:
                yield
            finally:
                self._background_scope = None

    def gc_cutoff(self, now: float | None = None) -> Lsn:
        cfg = self.config
        horizon = Lsn(min(max(0, self._last_record_lsn - cfg.gc_horizon), self.disk_consistent_lsn))
        if cfg.pitr_interval_s <= 0:
            pitr = self._last_record_lsn
        else:
            limit = (time.monotonic() if now is None else now) - cfg.pitr_interval_s
            older = [lsn for t, lsn in self._lsn_times if t <= limit]
            pitr = older[-1] if older else self.latest_gc_cutoff_lsn
        return Lsn(min(horizon, pitr))

    async def gc(self, retain_lsns: Sequence[Lsn] | Callable[[], Sequence[Lsn]] = ()) -> list[str]:
        """Remove layers below the cutoff that nothing needs; returns their names.

        ``retain_lsns`` (child branch points) may be a function: it is then called once the
        lock is held, with no await between it, the cutoff update and the choice of victims,
        so a branch created meanwhile is either counted or sees the new cutoff (and is
        refused), never neither."""
        removed: list[str] = []
        async with self._background_lock:
            if self._shut_down:
                return removed
            with self._background_round():
                removed = await self._gc_round(retain_lsns)
        return removed

    async def _gc_round(self, retain_lsns: Sequence[Lsn] | Callable[[], Sequence[Lsn]]) -> list[str]:
        """GC's whole round holds the layers lock too (no heavy IO in it, and the branch points
        must be read in the same step as the cutoff)."""
        from pageserver.storage.gc import select_gc_victims

        async with self._lock:
            cutoff = self.gc_cutoff()
            if self._reads_in_flight:
                cutoff = Lsn(min(cutoff, min(self._reads_in_flight)))
            if cutoff > self.latest_gc_cutoff_lsn:
                self.latest_gc_cutoff_lsn = cutoff
            retain = retain_lsns() if callable(retain_lsns) else retain_lsns
            victims = select_gc_victims(list(self._layer_map), self.latest_gc_cutoff_lsn, retain)
            # Persist the cutoff before deleting anything, even if nothing goes. Shielded, as
            # compaction's swap: a shutdown cancelling the round must not stop it between the
            # layer map and index_part (victims neither listed nor buried).
            with trio.CancelScope(shield=True):
                self._layer_map.replace(victims, [])
                try:
                    await self.write_index_part()
                except BaseException:
                    self._layer_map.replace([], victims)
                    raise
                self.graveyard.bury(victims)
            await self.graveyard.collect()
            return [v.path.name for v in victims]

    # -- reads -----------------------------------------------------------------------------

    def _admit(self, lsns: Iterable[int]) -> list[int]:
        """Register reads at ``lsns`` (called with no await since their GC-cutoff check)."""
        self._refuse_if_shut_down()
        admitted = list(set(lsns))
        flight = self._reads_in_flight
        for lsn in admitted:
            flight[lsn] = flight.get(lsn, 0) + 1
        return admitted

    def _refuse_if_shut_down(self) -> None:
        if self._shut_down:
            raise TimelineShutdownError(f"timeline {self.timeline_id.hex} is shut down")

    def _release(self, admitted: list[int]) -> None:
        for lsn in admitted:
            self._release_one(lsn)

    def _admit_one(self, lsn: int) -> None:
        """``_admit((lsn,))`` without its list (the lone request's read)."""
        self._refuse_if_shut_down()
        flight = self._reads_in_flight
        flight[lsn] = flight.get(lsn, 0) + 1

    def _release_one(self, lsn: int) -> None:
        flight = self._reads_in_flight
        left = flight[lsn] - 1
        if left:
            flight[lsn] = left
        else:
            del flight[lsn]

    @contextlib.contextmanager
    def reads_held_at(self, lsn: int) -> Iterator[None]:
        """Count the block as a read at ``lsn`` in flight, so that GC keeps its cutoff at or
        below ``lsn`` until it ends (a long reader: a basebackup)."""
        admitted = self._admit((lsn,))
        try:
            yield
        finally:
            self._release(admitted)

    def _raise_if_layers_closed(self) -> None:
        if self._layers_closed:
            raise TimelineShutdownError(
                f"timeline {self.timeline_id.hex} is shut down: its layers are closed, "
                "index_part is not written any more"
            )

    def _raise_if_shut_down(self) -> None:
        if self._shut_down:
            raise TimelineShutdownError(
                f"timeline {self.timeline_id.hex} was shut down while a read was in flight"
            )

    def _check_lsn(self, key: Key, lsn: Lsn) -> None:
        if lsn < self.latest_gc_cutoff_lsn:
            raise LsnBelowGcCutoffError(
                key, lsn, f"below the GC cutoff {format_lsn(self.latest_gc_cutoff_lsn)}"
            )

    async def _read(
        self, keys: Sequence[Key], lsn: Lsn, impl: Literal["vectored", "legacy"], use_cache: bool,
        ctx: ReadContext | None = None,
    ) -> dict[Key, Result]:
        async def walk(states: dict[Key, KeyState], ctx: ReadContext) -> None:
            if impl == "vectored":
                await read_path.get_vectored(self, list(states), lsn, states, ctx)
            else:
                for key, st in states.items():
                    await read_path.get_legacy(self, key, lsn, st)

        return await self._read_requests(dict.fromkeys(keys, lsn), walk, use_cache, ctx)

    def _seed_states(self, requests: dict[Key, Lsn], use_cache: bool) -> dict[Key, KeyState]:
        """A fresh ``KeyState`` per key, seeded from the page cache's hits."""
        hits = self.page_cache.lookup_many(self._key, requests) if use_cache else None
        if not hits:
            return {key: KeyState() for key in requests}
        return {key: KeyState() if (hit := hits.get(key)) is None else KeyState(hit[0], hit[1])
                for key in requests}

    async def _read_requests(
        self,
        requests: dict[Key, Lsn],
        walk: Callable[[dict[Key, KeyState], ReadContext], Awaitable[None]],
        use_cache: bool,
        ctx: ReadContext | None,
    ) -> dict[Key, Result]:
        """The body of every read: page-cache hits seed the key states, ``walk`` collects
        each key's values, then each key is reconstructed at its LSN (and memorized)."""
        states = self._seed_states(requests, use_cache)
        ctx = ctx or ReadContext(max_vectored_read_bytes=self.config.max_vectored_read_bytes)
        self.graveyard.readers += 1
        per_layer = self.graveyard.per_layer
        try:
            for attempt in range(1, READ_ATTEMPTS + 1):
                # Per layer: pinned (synchronously, with the superset computed) before any
                # await, so no layer this read may visit is evicted until it is done.
                pinned = self._pin_layers(requests) if per_layer else []
                try:
                    if self.graveyard.evicted:
                        # Counted as a reader (or pinned) first: what this downloads stays
                        # until the walk is done.
                        try:
                            await self.ensure_resident(
                                [(tl, x) for tl, x in pinned if not x.resident] if per_layer
                                else self.layers_needed(requests))
                        except (LayerDownloadError, LayerNotResidentError) as exc:
                            # This request fails (each key with the error); the connection and
                            # the node go on, and the next read tries the download again.
                            return {key: LayerDownloadError(key, lsn, str(exc)) for key, lsn in requests.items()}
                    await walk(states, ctx)
                    break
                except (LayerNotResidentError, LayerClosedError):
                    self._raise_if_shut_down()
                    # Per layer only: a layer that appeared after the pins were taken (a flush
                    # went up meanwhile) was evicted under the walk. Read again from scratch.
                    if not per_layer or attempt == READ_ATTEMPTS:
                        raise
                    log.info("a layer was evicted under a read; reading again", timeline_id=self.timeline_id.hex,
                             attempt=attempt)
                    states = self._seed_states(requests, use_cache)
                finally:
                    for _, x in pinned:
                        x.readers -= 1
        finally:
            self.graveyard.readers -= 1
        # a walk that went on after shutdown emptied the layer map saw no layers: its
        # "missing" keys are not missing
        self._raise_if_shut_down()
        await self.graveyard.collect()
        out: dict[Key, Result] = {}
        redone = 0
        for key, st in states.items():
            img = st.img
            if img is not None and st.complete and not st.records and not st.missing:
                out[key] = img[1]  # an image and nothing above it: reconstruct_value's answer
                continue
            if redone and redone % RECONSTRUCT_YIELD_EVERY == 0:
                # redo is CPU on the event loop: a batch of hundreds of keys (compaction's image
                # layers, with validation on) must not starve the page service's connections
                await trio.lowlevel.checkpoint()
            redone += 1
            out[key] = self._reconstruct(key, requests[key], st, use_cache)
        return out

    def _reconstruct(self, key: Key, lsn: Lsn, st: KeyState, use_cache: bool) -> Result:
        """The page from what the walk found (a reconstruct error is the answer, not raised),
        memorized in the page cache when redo made it."""
        try:
            page, applied = reconstruct_value(key, lsn, st, self.redo)
        except PageReconstructError as exc:
            return exc
        if use_cache and applied is not None:
            self.page_cache.memorize(self._key, key, applied, page)
        return page

    async def get_vectored_results(
        self, keys: KeySpace | Iterable[Key], lsn: Lsn, ctx: ReadContext | None = None
    ) -> dict[Key, Result]:
        """Values of ``keys`` at ``lsn``, each bytes or its own ``PageReconstructError``."""
        key_list = list(keys.iter_keys()) if isinstance(keys, KeySpace) else list(dict.fromkeys(keys))
        for key in key_list:
            self._check_lsn(key, lsn)
        admitted = self._admit((lsn,))
        try:
            impl = self.config.get_impl
            results = await self._read(key_list, lsn, impl, use_cache=True, ctx=ctx)
            if self.config.validate_get:
                other: Literal["vectored", "legacy"] = "legacy" if impl == "vectored" else "vectored"
                oracle = await self._read(key_list, lsn, other, use_cache=False)
                self._validate(lsn, results, oracle, impl, other)
        finally:
            self._release(admitted)
        return results

    def _validate(
        self, lsn: Lsn, got: dict[Key, Result], oracle: dict[Key, Result], impl: str, other: str
    ) -> None:
        bad = [k for k in got if not _same(got[k], oracle[k])]
        if not bad:
            return
        GET_VALIDATION_MISMATCHES.inc()
        diff = [
            f"{key_hex(k)}: {impl}={_describe(got[k])} {other}={_describe(oracle[k])}" for k in bad
        ]
        log.error(
            "get validation mismatch",
            tenant_id=self.tenant_id.hex,
            timeline_id=self.timeline_id.hex,
            lsn=format_lsn(lsn),
            diff=diff,
        )
        raise GetValidationError(
            f"read paths disagree at {format_lsn(lsn)} on {len(bad)} key(s): " + "; ".join(diff[:5])
        )

    async def get_vectored(
        self, keys: KeySpace | Iterable[Key], lsn: Lsn, ctx: ReadContext | None = None
    ) -> dict[Key, bytes]:
        """Values of ``keys`` at ``lsn``; raises the first per-key error."""
        out: dict[Key, bytes] = {}
        for key, result in (await self.get_vectored_results(keys, lsn, ctx)).items():
            if not isinstance(result, bytes):
                raise result
            out[key] = result
        return out

    async def get(self, key: Key, lsn: Lsn) -> bytes:
        """The value of ``key`` at ``lsn`` (``MissingKeyError`` if it does not exist)."""
        result = (await self.get_vectored_results([key], lsn))[key]
        if not isinstance(result, bytes):
            raise result
        return result

    async def _read_mixed(self, requests: dict[Key, Lsn], ctx: ReadContext | None) -> dict[Key, Result]:
        """``_read`` (vectored, with the page cache) for keys that each have their own LSN."""

        lsns = set(requests.values())
        if len(lsns) == 1:
            # Every key at one LSN (a page-service batch while no WAL arrives): the one-LSN
            # walk, which routes whole key lists per layer where the mixed one goes key by key.
            (lsn,) = lsns

            async def walk(states: dict[Key, KeyState], ctx: ReadContext) -> None:
                await read_path.get_vectored(self, list(states), lsn, states, ctx)
        else:

            async def walk(states: dict[Key, KeyState], ctx: ReadContext) -> None:
                await read_path.get_vectored_mixed(self, requests, states, ctx)

        return await self._read_requests(requests, walk, True, ctx)

    def _images_allowed(self, lsn: Lsn) -> bool:
        """Whether a read at ``lsn`` may try the image kernel first (``_read_images``): the
        lanes ``get_page`` takes, and no ``validate_get`` (which compares the general paths)."""
        config = self.config
        graveyard = self.graveyard
        return (self.image_fast_path and config.get_impl == "vectored" and not config.validate_get
                and not graveyard.per_layer and not graveyard.evicted and lsn >= self.latest_gc_cutoff_lsn)

    async def _read_images(
        self, keys: Sequence[Key], lsn: Lsn, into: read_path.Into | None = None, slots: Sequence[int] | None = None,
    ) -> list[Any] | None:
        """``read_path.read_images`` for keys the page cache holds nothing of (a lookup would
        miss: counted as such for the keys answered), with the layers kept open (a reader of
        the graveyard) and the shutdown checks of ``_read_requests``. None (or None per key):
        the general path answers."""
        page_cache = self.page_cache
        graveyard = self.graveyard
        graveyard.readers += 1
        try:
            pages = await read_path.read_images(self, keys, lsn, into, slots)
        except OSError:
            self._raise_if_shut_down()  # (a descriptor closed under a threadpool read)
            raise
        finally:
            graveyard.readers -= 1
        self._raise_if_shut_down()
        await graveyard.collect()
        if pages is not None:
            served = len(pages) - pages.count(None)
            page_cache.count_misses(served)
            self.image_fast_pages += served
        return pages

    async def _read_batch(
        self, batch: dict[Key, Lsn], lsn: Lsn, ctx: ReadContext | None, into: read_path.Into | None = None,
    ) -> list[Result | None]:
        """The answers of ``batch`` (every key at ``lsn``) in its order: the image kernel
        first, then the general walk (``_read_mixed``) for the keys it declined. With
        ``into``, None for a page the kernel read into its slot (``read_path.Into``)."""
        page_cache = self.page_cache
        keys = list(batch)
        slots: list[int] | None = None
        if page_cache._lsns:
            tl_key = self._key
            fast = [k for k in keys if not page_cache.holds(tl_key, k)]
            if into is not None and len(fast) != len(keys):
                slots = [i for i, k in enumerate(keys) if not page_cache.holds(tl_key, k)]
        else:
            fast = keys
        pages = await self._read_images(fast, lsn, into, slots) if fast else None
        if pages is None:
            results = await self._read_mixed(batch, ctx)
            return [results[key] for key in keys]
        if fast is keys and None not in pages:
            # the usual batch: every page an image (with ``into``: all in their slots)
            return [None] * len(keys) if into is not None else pages
        got: dict[Key, Result | None] = {
            k: (None if into is not None else p) for k, p in zip(fast, pages, strict=True) if p is not None}
        results = await self._read_mixed({k: lsn for k in keys if k not in got}, ctx)
        return [got[k] if k in got else results[k] for k in keys]

    async def get_pages(
        self, requests: Sequence[tuple[Key, Lsn]], ctx: ReadContext | None = None
    ) -> list[Result]:
        """Many (key, lsn) requests, LSNs mixed, in one vectored walk (neon#10765); results in
        request order. A key asked at several LSNs (the page service's scattered-lsn batching
        never does that) costs one more walk per extra LSN: a walk holds one LSN per key."""
        if self.config.get_impl != "vectored":
            return await self.get_pages_per_lsn(requests)
        batch = dict(requests)
        if len(batch) == len(requests) and (not batch or min(batch.values()) >= self.latest_gc_cutoff_lsn):
            # The usual batch: every key once (so at one LSN), none below the GC cutoff: one
            # walk, no per-request bookkeeping of rounds and answers.
            admitted = self._admit(batch.values())
            try:
                if len(admitted) == 1 and self._images_allowed(Lsn(admitted[0])):
                    return await self._read_batch(batch, Lsn(admitted[0]), ctx)  # type: ignore[return-value]
                results = await self._read_mixed(batch, ctx)
                if self.config.validate_get:
                    await self._validate_mixed(batch, results)
            finally:
                self._release(admitted)
            return [results[key] for key in batch]
        answers: dict[tuple[Key, Lsn], Result] = {}
        rounds: list[dict[Key, Lsn]] = []
        for key, lsn in dict.fromkeys(requests):
            if lsn < self.latest_gc_cutoff_lsn:
                answers[(key, lsn)] = LsnBelowGcCutoffError(
                    key, lsn, f"below the GC cutoff {format_lsn(self.latest_gc_cutoff_lsn)}"
                )
                continue
            for batch in rounds:
                if key not in batch:
                    batch[key] = lsn
                    break
            else:
                rounds.append({key: lsn})
        admitted = self._admit(lsn for batch in rounds for lsn in batch.values())
        try:
            for batch in rounds:
                results = await self._read_mixed(batch, ctx)
                if self.config.validate_get:
                    await self._validate_mixed(batch, results)
                for key, lsn in batch.items():
                    answers[(key, lsn)] = results[key]
        finally:
            self._release(admitted)
        return [answers[(key, lsn)] for key, lsn in requests]

    async def get_pages_at(
        self, keys: Sequence[Key], lsn: Lsn, ctx: ReadContext | None = None, into: read_path.Into | None = None,
    ) -> list[Result | None]:
        """``get_pages([(key, lsn) for key in keys])`` (the page service's usual batch: one
        LSN), without the pairs: distinct keys at or above the GC cutoff try the image kernel
        first (``_read_batch``); anything else is ``get_pages``. With ``into`` (``(out, dest,
        stride)``), a page the kernel reads goes straight to ``out[dest + i * stride:]`` and
        its answer is None; every other answer is as ``get_pages`` gives it."""
        batch = dict.fromkeys(keys, lsn)
        if len(batch) != len(keys) or not self._images_allowed(lsn):
            return await self.get_pages([(key, lsn) for key in keys], ctx)  # type: ignore[return-value]
        self._admit_one(lsn)
        try:
            return await self._read_batch(batch, lsn, ctx, into)
        finally:
            self._release_one(lsn)

    async def get_page(self, key: Key, lsn: Lsn, ctx: ReadContext | None = None) -> Result:
        """``get_pages([(key, lsn)])[0]``, the same answer and errors, without a batch's
        machinery (the page service's lone requests at queue depth 1): no request dict, LSN
        set, key list or result list; one page-cache lookup, ``read_path.get_one``.

        Only the common read takes this lane: the vectored path, ``validate_get`` off, at or
        above the GC cutoff, no layer of the tenant evicted and no per-layer pinning. Anything
        else is ``get_pages``'s general path, unchanged."""
        config = self.config
        graveyard = self.graveyard
        if (config.get_impl != "vectored" or config.validate_get or graveyard.per_layer
                or graveyard.evicted or lsn < self.latest_gc_cutoff_lsn):
            return (await self.get_pages(((key, lsn),), ctx))[0]
        self._admit_one(lsn)
        try:
            page_cache = self.page_cache
            if self.image_fast_path and not page_cache.holds(self._key, key):
                got = await self._read_images((key,), lsn)
                if got is not None and (page := got[0]) is not None:
                    return page  # type: ignore[no-any-return]  # (bytes: no ``into``)
            hit = page_cache.lookup(self._key, key, lsn)
            st = KeyState() if hit is None else KeyState(hit[0], hit[1])
            ctx = ctx or ReadContext(max_vectored_read_bytes=config.max_vectored_read_bytes)
            graveyard.readers += 1
            try:
                await read_path.get_one(self, key, lsn, st, ctx)
            except (LayerNotResidentError, LayerClosedError):
                self._raise_if_shut_down()
                raise
            finally:
                graveyard.readers -= 1
            self._raise_if_shut_down()
            await graveyard.collect()
            img = st.img
            if img is not None and st.complete and not st.records and not st.missing:
                return img[1]  # an image and nothing above it: reconstruct_value's answer
            return self._reconstruct(key, lsn, st, True)
        finally:
            self._release_one(lsn)

    async def _validate_mixed(self, batch: dict[Key, Lsn], results: dict[Key, Result]) -> None:
        """``validate_get`` for a mixed-LSN read: the legacy path per LSN as the oracle."""
        by_lsn: dict[Lsn, list[Key]] = {}
        for key, lsn in batch.items():
            by_lsn.setdefault(lsn, []).append(key)
        for lsn, keys in by_lsn.items():
            oracle = await self._read(keys, lsn, "legacy", use_cache=False)
            got = {k: results[k] for k in keys}
            self._validate(lsn, got, oracle, "vectored-mixed", "legacy")

    async def get_pages_per_lsn(self, requests: Sequence[tuple[Key, Lsn]]) -> list[Result]:
        """``get_pages`` the old way, one walk per distinct LSN (an oracle for tests/benches)."""
        by_lsn: dict[Lsn, list[Key]] = {}
        for key, lsn in requests:
            by_lsn.setdefault(lsn, []).append(key)
        answers: dict[tuple[Key, Lsn], Result] = {}
        for lsn, keys in by_lsn.items():
            try:
                results = await self.get_vectored_results(keys, lsn)
            except LsnBelowGcCutoffError as exc:
                results = dict.fromkeys(keys, exc)
            for key, result in results.items():
                answers[(key, lsn)] = result
        return [answers[(key, lsn)] for key, lsn in requests]

    async def get_rel_size(self, spcnode: int, dbnode: int, relnode: int, forknum: int, lsn: Lsn) -> int:
        """Number of blocks (the rel-size key holds a u32 little-endian)."""
        raw = await self.get(rel_size_key(spcnode, dbnode, relnode, forknum), lsn)
        if len(raw) != 4:
            raise PageReconstructError(
                rel_size_key(spcnode, dbnode, relnode, forknum), lsn, f"rel size value has {len(raw)} bytes"
            )
        return int(struct.unpack("<I", raw)[0])

    async def get_rel_exists(self, spcnode: int, dbnode: int, relnode: int, forknum: int, lsn: Lsn) -> bool:
        try:
            await self.get_rel_size(spcnode, dbnode, relnode, forknum, lsn)
        except MissingKeyError:
            return False
        return True

    # -- residency (on-demand download, eviction) --------------------------------------------

    def _pin_layers(self, requests: dict[Key, Lsn]) -> list[tuple[Timeline, PersistentLayer]]:
        """Count a read in on every layer it may visit (resident or not); marks them used."""
        layers = self.layers_needed(requests, resident_too=True)
        now = time.monotonic()
        for _, x in layers:
            x.readers += 1
            x.last_access = now
        return layers

    def layers_needed(self, requests: dict[Key, Lsn], *, all_keys: bool = False,
                      resident_too: bool = False) -> list[tuple[Timeline, PersistentLayer]]:
        """Non-resident layers (all, with ``resident_too``) of this timeline and its ancestors
        a read of ``requests`` may visit (a superset: every layer overlapping the keys' span
        below the highest LSN)."""
        out: list[tuple[Timeline, PersistentLayer]] = []
        if not requests:
            return out
        lo, hi = min(requests), max(requests)
        span = None if all_keys or hi == KEY_MAX else KeyRange(lo, key_next(hi))
        limit: int = max(requests.values())
        tl: Timeline | None = self
        while tl is not None:
            # Below an image layer covering the whole span no read goes: the walk of every
            # key ends there (at the latest).
            image = None if span is None else tl._layer_map.newest_image_covering(span, limit)
            floor = -1 if image is None else image.desc.image_lsn
            for layer in tl._layer_map:
                d = layer.desc
                if (layer.resident and not resident_too) or d.lsn_start > limit or (
                        layer is not image and d.lsn_end <= floor):
                    continue
                if all_keys or (d.key_range.start <= hi and lo < d.key_range.end):
                    out.append((tl, layer))
            if image is not None:
                break
            limit = min(limit, tl.ancestor_lsn)
            tl = tl.ancestor
        return out

    async def ensure_resident(self, layers: Sequence[tuple[Timeline, PersistentLayer]]) -> None:
        """Download the layers that are not on local disk (in parallel; each once, however
        many readers want it). ``LayerDownloadError`` if one cannot be had."""
        if not layers:
            return
        failures: list[LayerDownloadError] = []
        async with trio.open_nursery() as nursery:
            limiter = trio.CapacityLimiter(8)

            async def one(tl: Timeline, layer: PersistentLayer) -> None:
                async with limiter:
                    try:
                        await tl._make_resident(layer)
                    except LayerDownloadError as exc:
                        failures.append(exc)  # the others go on: they may serve the next read

            for tl, layer in layers:
                nursery.start_soon(one, tl, layer)
        if failures:
            raise failures[0]

    async def _make_resident(self, layer: PersistentLayer) -> None:
        if layer.residency_lock is None:
            layer.residency_lock = trio.Lock()
        async with layer.residency_lock:
            layer.last_access = time.monotonic()
            if layer.resident:
                return
            if self.remote is None:
                raise LayerDownloadError(
                    layer.desc.key_range.start, layer.desc.lsn_start,
                    f"layer {layer.path.name} is not on local disk and there is no remote storage",
                )
            try:
                await self.remote.download_layer(layer.path.name, layer.path, layer.file_size)
                reader = await LayerFileReader.open(self.engine, layer.path, self.index_cache)
            except Exception as exc:
                LAYER_DOWNLOAD_FAILURES.inc()
                log.warning("layer download failed", tenant_id=self.tenant_id.hex,
                            timeline_id=self.timeline_id.hex, layer=layer.path.name, error=str(exc))
                raise LayerDownloadError(
                    layer.desc.key_range.start, layer.desc.lsn_start,
                    f"layer {layer.path.name} could not be downloaded from remote storage: {exc}",
                ) from exc
            if reader.summary.file_size != layer.file_size:
                await reader.aclose()
                raise LayerDownloadError(
                    layer.desc.key_range.start, layer.desc.lsn_start,
                    f"layer {layer.path.name}: downloaded {reader.summary.file_size} bytes, expected {layer.file_size}",
                )
            layer.set_reader(reader)
            self.graveyard.evicted -= 1
            LAYER_DOWNLOADS.inc()

    def can_evict(self, layer: PersistentLayer) -> bool:
        """Uploaded (the remote index names it, no upload pending) and on local disk."""
        remote = self.remote
        return (
            remote is not None
            and layer.resident
            and layer.path not in self.graveyard.pins
            and remote.layer_generation(layer.path.name) is not None
            and not self._shut_down
        )

    async def evict(self, layer: PersistentLayer) -> bool:
        """Drop ``layer``'s local file (it stays in the layer map, and in remote storage) at
        the next moment no read of the tenant is in progress (now, if none is), unless a
        compaction or GC round of this timeline or a download of it is running then. Returns
        whether it was asked for."""
        if not self.can_evict(layer):
            return False
        self.graveyard.request_eviction(self, layer)
        await self.graveyard.collect()
        return True

    def begin_eviction(self, layer: PersistentLayer) -> LayerFileReader | None:
        """The synchronous half (no read in progress): take the locks, swap the reader out.
        None if it is not safe now (the request is dropped; the next round asks again)."""
        if not self.can_evict(layer) or layer.readers or layer not in set(self._layer_map):
            return None
        lock = self._background_lock
        if layer.residency_lock is None:
            layer.residency_lock = trio.Lock()
        # (held by anyone, this task included: a compaction's own reads collect too)
        if lock.locked() or layer.residency_lock.locked():
            return None
        lock.acquire_nowait()
        layer.residency_lock.acquire_nowait()
        reader = layer.reader
        layer.set_reader(EvictedReader(layer.path, layer.file_size))
        self.graveyard.evicted += 1
        return reader

    async def finish_eviction(self, layer: PersistentLayer, reader: LayerFileReader) -> None:
        """Close and unlink the old file, then let downloads and compaction go on."""
        try:
            with trio.CancelScope(shield=True):
                await reader.aclose()
                await self.engine.unlink(layer.path)
            LAYER_EVICTIONS.inc()
        finally:
            assert layer.residency_lock is not None
            layer.residency_lock.release()
            self._background_lock.release()

    # -- lifecycle ---------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Drop in-memory layers (their WAL is re-ingested after a restart) and close files.
        A compaction or GC round still running is cancelled (its outputs deleted) and waited
        for first: it reads the layers closed here."""
        self._shut_down = True
        if self._background_scope is not None:
            self._background_scope.cancel()
        background_flush = self._background_flush
        if background_flush is not None:
            # a rolled layer's L0 still being written: cancelled (the worker is killed), the
            # layer's WAL is re-ingested after a restart like any in-memory layer's
            background_flush[0].cancel()
            with trio.CancelScope(shield=True):
                await background_flush[1].wait()
        lock = self._background_lock
        try:
            lock.acquire_nowait()  # no checkpoint: callers shut down from cancelled scopes too
        except trio.WouldBlock:
            with trio.CancelScope(shield=True):
                await lock.acquire()
        try:
            await self._close_layers()
        finally:
            lock.release()
            await self.l0_worker.aclose()  # (shielded inside: no process outlives its timeline)

    async def _close_layers(self) -> None:
        self._layers_closed = True
        for layer in self.in_memory_layers():
            await layer.aclose()
        self.open_layer = None
        self.frozen_layers = []
        for hist in list(self._layer_map):
            await hist.aclose()
        self._layer_map = LayerMap()
