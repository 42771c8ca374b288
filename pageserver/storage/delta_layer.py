"""Persistent layers (delta and image) over a layer file, and their two read paths.

``PersistentLayer`` is the read side of both kinds (they share ``layer_file``'s format; the
image layer subclass in ``image_layer`` only changes what an absent key means). Each layer
answers:

- the legacy, per-key read (``get_value_legacy``): index lookup for one key, then one ``pread``
  per blob, newest first, stopping at an image or a will_init record;
- the vectored read (``get_values_vectored`` / ``plan_reads``, ``plan_key`` for one key): the
  planning kernel (``_plan_c.plan_cached``, twin ``_plan_py``) searches the index blocks for
  each run of consecutive keys routed here and plans, per key, the blobs from its newest
  will_init entry upward (and above its cached LSN), from the block cache without a coroutine
  (``try_plan``), or over the blocks read first when the cache lacks some; physically adjacent
  planned blobs are read with one ``preadv`` up to ``max_vectored_read_bytes`` by
  ``execute_reads``, all layers' reads in one engine call after the walk; then values are
  checked, decoded and handed to the keys newest first.

``write_delta_layer`` builds a delta layer file from (key, lsn, blob, will_init) entries.
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from crc32c import crc32c

from pageserver.storage import _blobs_select, _plan_select
from pageserver.storage.io_engine import IoEngine
from pageserver.storage.key import KEY_SIZE, Key, KeyRange, key_next
from pageserver.storage.layer_file import (
    DATA_START,
    IndexBlock,
    IndexBlockCache,
    IndexEntry,
    LayerClosedError,
    LayerCorruptionError,
    LayerDesc,
    LayerFileReader,
    LayerFileWriter,
    WriteOptions,
    prefix_of,
    write_layer_file,
)
from pageserver.storage.reconstruct import KeyState
from pageserver.storage.value import (
    VALUE_DECODERS,
    Value,
    decode_value,
)
from protocol.lsn import MAX_LSN, Lsn

_layer_ids = itertools.count(1)


@attrs.define(slots=True)
class ReadContext:
    """Settings, the planned blob reads, and counters of one vectored read.

    The walk only *plans* reads of persistent layers (from their indexes); ``execute_reads``
    then performs every planned read at once — one engine call, so the threadpool engine pays
    one thread hop per batch, not one per layer — and ``resolve_states`` hands the decoded
    values to the keys, in the order the walk found them.
    """

    max_vectored_read_bytes: int = 128 * 1024
    # Whether any key was seeded from the materialized page cache: only then can a walk's
    # floor finish a key, so the per-key floor checks are skipped otherwise.
    any_cached: bool = False
    layers_visited: int = 0
    vectored_reads: int = 0
    blobs_read: int = 0
    # planned: (reader, file offset, total bytes, first slot, number of blobs)
    reads: list[tuple[LayerFileReader, int, int, int, int]] = attrs.field(factory=list)
    # slot -> (offset, length, crc) of one blob
    blobs: list[tuple[int, int, int]] = attrs.field(factory=list)
    # Called (once, then cleared) when a layer needs an index block the cache lacks: the walk
    # sets it to prefetch the index blocks of every layer it may still visit.
    on_index_miss: Callable[[], None] | None = None


# preadv2's RWF_NOWAIT (Linux >= 4.14): read only what the page cache holds. Switched off for
# good the first time a file system refuses it.
_nowait = [hasattr(os, "RWF_NOWAIT")]
# the blob-gather kernel (a module attribute, so tests can put the twin in its place)
_gather_blobs = _blobs_select.gather_blobs
_ShortRead = _blobs_select.ShortRead
_BlobOutsideRead = _blobs_select.BlobOutsideRead
_BlobChecksumError = _blobs_select.BlobChecksumError
# the layer-planning kernel (a module attribute, so tests can put the twin in its place)
_plan_cached = _plan_select.plan_cached
_EntryOutsideData = _plan_select.EntryOutsideData


def _fd_of(reader: LayerFileReader) -> int:
    # A file closed since the walk planned its reads (a timeline shut down under the read)
    # must not be read: its descriptor number may already belong to another file.
    if reader.file.closed:
        raise LayerClosedError(reader.path)
    return reader.file.fd


async def execute_reads(ctx: ReadContext) -> list[Value | bytes]:
    """Perform every planned read; returns the decoded value of every blob slot (an image as
    its bare page bytes: its encoding is the tag and the page, so no ``Image`` is built only
    to be taken apart again by ``KeyState.resolve``).

    The reads, their CRC checks and the image copies are one call of the blob-gather kernel
    (``_blobs_c.gather_blobs``, or its twin ``_blobs_py``), run by the IO engine: on the
    threadpool engine the native kernel reads and checks without the GIL."""
    if not ctx.reads:
        return []
    engine = ctx.reads[0][0].engine
    blobs = ctx.blobs
    try:
        # the planned reads as they are: the kernel asks ``_fd_of`` once per layer of them
        raw, kinds, calls, supported, nbytes = await engine.run_sync(
            _gather_blobs, ctx.reads, blobs, _fd_of, _nowait[0]
        )
    except _ShortRead as exc:
        n, got, total = exc.args
        reader, offset = ctx.reads[n][0], ctx.reads[n][1]
        raise LayerCorruptionError(reader.path, f"short read at {offset}: {got} of {total} bytes") from None
    except (_BlobOutsideRead, _BlobChecksumError) as exc:
        n, slot = exc.args
        off = blobs[slot][0]
        what = "checksum mismatch" if isinstance(exc, _BlobChecksumError) else "outside its read"
        raise LayerCorruptionError(ctx.reads[n][0].path, f"blob at offset {off} {what}") from None
    if not supported:
        _nowait[0] = False
    engine.stats.preadvs += calls
    engine.stats.bytes_read += nbytes
    values: list[Value | bytes]
    if 0 not in kinds:
        values = raw  # type: ignore[assignment]  # all images: the bare pages
    else:
        # decode_value's dispatch inlined; what it would reject goes to it for the error
        decoders = VALUE_DECODERS
        n_tags = len(decoders)
        values = []
        append = values.append
        for data, kind in zip(raw, kinds, strict=True):
            if kind:
                append(data)
                continue
            tag = data[0] if data else n_tags
            if tag < n_tags:
                append(decoders[tag](memoryview(data)[1:]))
            else:
                append(decode_value(data))
    ctx.vectored_reads += len(ctx.reads)
    ctx.blobs_read += len(values)
    ctx.reads.clear()
    ctx.blobs.clear()
    return values


async def read_and_resolve(ctx: ReadContext, states: Iterable[KeyState]) -> None:
    values = await execute_reads(ctx)
    for st in states:
        pending = st.pending
        if pending is None:
            continue
        if len(pending) == 1:
            # the usual key: one blob planned, an image (``KeyState.resolve``'s first step)
            lsn, item = pending[0]
            if type(item) is int and type(value := values[item]) is bytes:
                st.pending = None
                st.img = (lsn, value)
                continue
        st.resolve(values)


def _index_miss(ctx: ReadContext) -> None:
    hook = ctx.on_index_miss
    if hook is not None:
        ctx.on_index_miss = None
        hook()


def _lsn_of(prefix: bytes) -> int:
    return int.from_bytes(prefix[KEY_SIZE:], "big")


def _range_end_prefix(key: Key, cont: int) -> bytes:
    """Prefix bound just past (key, cont - 1)."""
    if cont > MAX_LSN:
        return prefix_of(key_next(key), 0)
    return prefix_of(key, cont)


class LayerNotResidentError(Exception):
    """A layer's file is not on local disk (evicted, or not downloaded yet since attach);
    ``Timeline.ensure_resident`` fetches it from remote storage before a read."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"layer {path.name} is not resident")
        self.path = path


class EvictedReader:
    """Stands in for the ``LayerFileReader`` of a layer whose file is only in remote storage:
    any use but ``path``, ``file_size`` and ``aclose`` raises ``LayerNotResidentError``."""

    def __init__(self, path: Path, file_size: int) -> None:
        self.path = path
        self.file_size = file_size

    async def aclose(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise LayerNotResidentError(self.path)


class PersistentLayer:
    """A delta layer file; also the base of ``ImageLayer``.

    Resident (``reader`` is the open file) or evicted (``reader`` is an ``EvictedReader``: the
    file is in remote storage only); the layer map holds both. ``last_access`` (monotonic
    seconds) orders eviction."""

    def __init__(self, desc: LayerDesc, reader: LayerFileReader | EvictedReader) -> None:
        self.desc = desc
        self.reader: LayerFileReader = reader  # type: ignore[assignment]  # (EvictedReader raises on use)
        self.layer_id = next(_layer_ids)
        self.file_size = reader.file_size if isinstance(reader, EvictedReader) else reader.summary.file_size
        self.last_access = time.monotonic()
        self.residency_lock: trio.Lock | None = None
        # Reads in progress that may visit it (counted only in a tenant that evicts: see
        # ``pageserver.timeline.LayerGraveyard.per_layer``); it is not evicted while > 0.
        self.readers = 0

    @classmethod
    def evicted(cls, path: Path, file_size: int) -> PersistentLayer:
        """A layer known by name and size only (its file to be downloaded on first use)."""
        from pageserver.storage.image_layer import ImageLayer
        from pageserver.storage.layer_file import LayerCorruptionError

        desc = LayerDesc.parse_file_name(path.name)
        if desc is None:
            raise LayerCorruptionError(path, "not a layer file name")
        reader = EvictedReader(path, file_size)
        return ImageLayer(desc, reader) if not desc.is_delta else cls(desc, reader)

    @property
    def resident(self) -> bool:
        return not isinstance(self.reader, EvictedReader)

    def set_reader(self, reader: LayerFileReader | EvictedReader) -> None:
        self.reader = reader  # type: ignore[assignment]

    @classmethod
    async def open(
        cls, engine: IoEngine, path: Path, cache: IndexBlockCache
    ) -> PersistentLayer:
        """Open and check a layer file; the class follows from its name (image or delta)."""
        from pageserver.storage.image_layer import ImageLayer
        from pageserver.storage.layer_file import DELTA_MAGIC, LayerCorruptionError

        desc = LayerDesc.parse_file_name(path.name)
        if desc is None:
            raise LayerCorruptionError(path, "not a layer file name")
        reader = await LayerFileReader.open(engine, path, cache)
        s = reader.summary
        expected = LayerDesc(s.key_range, s.lsn_start, s.lsn_end, s.magic == DELTA_MAGIC)
        if expected != desc:
            await reader.aclose()
            raise LayerCorruptionError(path, f"summary describes {expected}, not its name")
        return ImageLayer(desc, reader) if not desc.is_delta else cls(desc, reader)

    @property
    def path(self) -> Path:
        return self.reader.path

    async def aclose(self) -> None:
        await self.reader.aclose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.desc}>"

    # -- legacy per-key path --------------------------------------------------------------

    async def get_value_legacy(self, key: Key, floor: int, cont: int, state: KeyState) -> None:
        r = self.reader
        entries: list[IndexEntry] = []
        for block, lo, hi in await r.scan(prefix_of(key, floor), _range_end_prefix(key, cont)):
            entries.extend(block.entry(i) for i in range(lo, hi))
        for e in reversed(entries):
            blob = await r.read_blob(e.offset, e.length, e.crc)
            if state.add(e.lsn, decode_value(blob)):
                break
        if not entries:
            self._absent(state, floor)

    def _absent(self, state: KeyState, floor: int) -> None:
        """A key routed here has nothing in range. Deltas: keep walking down."""

    # -- vectored path --------------------------------------------------------------------

    async def get_values_vectored(
        self,
        keys: Sequence[Key],
        floor: int,
        cont: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> None:
        """Plan the reads of ``[floor, cont)`` for the sorted, distinct ``keys`` (their states
        must be deferring: ``pending`` set); ``execute_reads`` performs them."""
        await self.plan_reads(keys, floor, cont, states, ctx)

    async def plan_reads(
        self,
        keys: Sequence[Key],
        floor: int,
        cont: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> Sequence[Key]:
        """``get_values_vectored`` that returns the keys still incomplete after this layer
        (``keys`` itself when none completed), so the walk needs no pass over all its keys.
        ``try_plan`` is the same without a coroutine when the index blocks are cached.

        There is one planner, the planning kernel: when the block cache lacks a block the
        search needs, the blocks are read (through the cache) and the kernel runs over them
        as they were read, so a cache too small for one read's blocks plans the same."""
        left = self.try_plan(keys, floor, cont, states, ctx)
        if left is not None:
            return left
        return await self._plan_cold(keys, floor, cont, states, ctx)

    async def _plan_cold(
        self,
        keys: Sequence[Key],
        floor: int,
        cont: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> Sequence[Key]:
        """``plan_reads`` once the cache is known to lack a block the search needs."""
        _index_miss(ctx)
        blocks = await self.reader.load_blocks(scan_bounds(keys))
        left = self._plan_in(blocks, False, keys, floor, cont, states, ctx)
        if left is None:
            raise AssertionError("the planning kernel needs an index block load_blocks did not read")
        return left

    def try_plan(
        self,
        keys: Sequence[Key],
        floor: int,
        cont: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> Sequence[Key] | None:
        """``plan_reads`` if every index block it needs is cached, else None (and nothing
        planned): the hot walk makes no coroutine per layer. The search and the plan are one
        call of the planning kernel (``_plan_c.plan_cached``, or its twin ``_plan_py``), which
        finds the runs of ``keys`` itself."""
        return self._plan_in(self.reader.cache._blocks, True, keys, floor, cont, states, ctx)

    def _plan_in(
        self,
        blocks: MutableMapping[tuple[int, int], IndexBlock],
        cached: bool,
        keys: Sequence[Key],
        floor: int,
        cont: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> Sequence[Key] | None:
        """The planning kernel over ``blocks`` (the block cache's LRU dict when ``cached``:
        its hits are counted there)."""
        r = self.reader
        summary = r.summary
        try:
            got = _plan_cached(
                r.fences, summary.n_index_blocks, blocks, r.file_id, keys, floor, cont,
                states, ctx.blobs, ctx.reads, r, ctx.max_vectored_read_bytes, DATA_START,
                summary.data_end,
            )
        except _EntryOutsideData as exc:
            r.check_entry(*exc.args)  # raises LayerCorruptionError naming the file
            raise AssertionError("the planning kernel and check_entry disagree") from exc
        if got is None:
            return None
        hits, completed = got
        if cached:
            r.cache.hits += hits
        ctx.layers_visited += 1
        if ctx.any_cached or completed or self.completes_keys:
            return self._remaining(keys, floor, states, ctx)
        return keys

    async def plan_key(
        self, key: Key, floor: int, cont: int, st: KeyState, ctx: ReadContext
    ) -> None:
        """``plan_reads`` for one key (``try_plan_key`` without a coroutine)."""
        if not self.try_plan_key(key, floor, cont, st, ctx):
            await self._plan_cold((key,), floor, cont, {key: st}, ctx)

    def try_plan_key(
        self, key: Key, floor: int, cont: int, st: KeyState, ctx: ReadContext
    ) -> bool:
        """``plan_key`` if the key's index blocks are cached; else False, with nothing
        planned. The same planning kernel as for many keys."""
        if st.complete:
            return True
        return self._plan_in(self.reader.cache._blocks, True, (key,), floor, cont, {key: st}, ctx) is not None

    # Whether every key routed here ends here (image layers): ``_remaining`` must run.
    completes_keys = False

    def _remaining(
        self, keys: Sequence[Key], floor: int, states: dict[Key, KeyState], ctx: ReadContext
    ) -> Sequence[Key]:
        # Keys whose cached page is at or above this layer's floor are done (PR #7477).
        if ctx.any_cached:
            for key in keys:
                states[key].floor_reached(floor)
        return [key for key in keys if not states[key].complete]

    # -- whole-layer access (compaction, key collection) -----------------------------------

    async def iter_entries(self, batch_bytes: int = 1 << 20) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
        """Every (key, lsn, blob, will_init) in order; blobs read sequentially in big chunks."""
        async for batch in self.iter_entry_batches(batch_bytes):
            for entry in batch:
                yield entry

    async def iter_entry_batches(
        self, batch_bytes: int = 1 << 20
    ) -> AsyncIterator[list[tuple[Key, Lsn, bytes, bool]]]:
        """``iter_entries`` as lists of about ``batch_bytes`` of blobs (compaction's merge):
        one ``read_blobs`` per list, the checks (every blob's crc32c, the positions following
        each other) and the tuples made by C loops rather than a generator step per entry."""
        r = self.reader
        keys: list[Key] = []
        lsns: list[Lsn] = []
        positions: list[int] = []
        lengths: list[int] = []
        crcs: list[int] = []
        pending = 0
        n_blocks = r.summary.n_index_blocks
        for blkno in range(n_blocks):
            block = await r.block(blkno)
            keys += block.keys
            lsns += block.lsns
            positions += block.positions
            lengths += block.lengths
            crcs += block.crcs
            pending += sum(block.lengths)
            while lengths and (pending >= batch_bytes or blkno == n_blocks - 1):
                # the entries up to about batch_bytes (at least one)
                j = min(len(lengths), bisect.bisect_left(list(itertools.accumulate(lengths)), batch_bytes) + 1)
                yield await self._entry_batch(keys[:j], lsns[:j], positions[:j], lengths[:j], crcs[:j])
                pending -= sum(lengths[:j])
                del keys[:j], lsns[:j], positions[:j], lengths[:j], crcs[:j]

    async def _entry_batch(
        self, keys: list[Key], lsns: list[Lsn], positions: list[int], lengths: list[int], crcs: list[int]
    ) -> list[tuple[Key, Lsn, bytes, bool]]:
        r = self.reader
        start = positions[0] >> 1
        offsets = [p >> 1 for p in positions]
        if offsets != list(itertools.accumulate(lengths[:-1], initial=start)):
            raise LayerCorruptionError(self.path, f"index entries from offset {start} do not follow each other")
        blobs = await r.read_blob_copies(start, lengths)
        if list(map(crc32c, blobs)) != crcs:
            for off, length, crc, blob in zip(offsets, lengths, crcs, blobs, strict=True):
                r.check_blob(off, length, crc, blob)  # raises for the first bad one
        return list(zip(keys, lsns, blobs, [bool(p & 1) for p in positions], strict=True))

    async def iter_index(self) -> AsyncIterator[tuple[Key, Lsn, int]]:
        """(key, lsn, blob length) of every entry, from the index alone."""
        r = self.reader
        for blkno in range(r.summary.n_index_blocks):
            block = await r.block(blkno)
            for p, length in zip(block.prefixes, block.lengths, strict=True):
                yield Key(p[:KEY_SIZE]), Lsn(_lsn_of(p)), length


def key_runs(keys: Sequence[Key]) -> list[tuple[Key, Key]]:
    """Sorted distinct keys -> inclusive ``(first, last)`` runs of consecutive keys."""
    if not keys:
        return []
    first = keys[0]
    if len(keys) == 1:
        return [(first, first)]
    prev = int.from_bytes(first, "big")
    if int.from_bytes(keys[-1], "big") - prev == len(keys) - 1:
        return [(first, keys[-1])]  # the common case: one run of blocks (sorted and distinct)
    runs: list[tuple[Key, Key]] = []
    start = last = first
    for key in keys[1:]:
        value = int.from_bytes(key, "big")
        if value != prev + 1:
            runs.append((start, last))
            start = key
        prev = value
        last = key
    runs.append((start, last))
    return runs


def scan_bounds(keys: Sequence[Key]) -> list[tuple[bytes, bytes]]:
    """Index scan bounds ``[first + lsn 0, last + above every lsn)`` of each run of keys."""
    return [(first + ZERO_LSN, last + ALL_LSNS_END) for first, last in key_runs(keys)]


# Above every (key, lsn) prefix of the same key: scanning [key + 0*8, key + this) covers all LSNs.
ALL_LSNS_END = b"\xff" * 9
ZERO_LSN = bytes(8)
_ABOVE_ALL_LSNS = 1 << 64


async def write_delta_layer(
    engine: IoEngine,
    directory: Path,
    key_range: KeyRange,
    lsn_start: Lsn,
    lsn_end: Lsn,
    entries: AsyncIterator[tuple[Key, Lsn, bytes | bytearray | memoryview, bool]],
    *,
    opts: WriteOptions | None = None,
) -> Path | None:
    """Write a delta layer from entries in (key, lsn) order; None if there were none."""
    async def fill(writer: LayerFileWriter) -> None:
        async for key, lsn, blob, will_init in entries:
            await writer.put(key, lsn, blob, will_init)

    return await write_layer_file(engine, directory, LayerDesc(key_range, lsn_start, lsn_end, True), opts, fill)
