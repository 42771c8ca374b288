"""Persistent layers (delta and image) over a layer file, and their two read paths.

``PersistentLayer`` is the read side of both kinds (they share ``layer_file``'s format; the
image layer subclass in ``image_layer`` only changes what an absent key means). Each layer
answers:

- the legacy, per-key read (``get_value_legacy``): index lookup for one key, then one ``pread``
  per blob, newest first, stopping at an image or a will_init record;
- the vectored read (``get_values_vectored``): one index scan per run of consecutive keys, for
  all keys routed here; a plan keeps, per key, the blobs from its newest will_init entry upward (and above its
  cached LSN); physically adjacent planned blobs are read with one ``preadv`` up to
  ``max_vectored_read_bytes``; then values are applied newest first.

``write_delta_layer`` builds a delta layer file from (key, lsn, blob, will_init) entries.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

import attrs

from pageserver.storage.io_engine import IoEngine
from pageserver.storage.key import KEY_SIZE, Key, KeyRange, key_next
from pageserver.storage.layer_file import (
    IndexBlockCache,
    IndexEntry,
    LayerCorruptionError,
    LayerDesc,
    LayerFileReader,
    LayerFileWriter,
    WriteOptions,
    prefix_of,
)
from pageserver.storage.reconstruct import KeyState
from pageserver.storage.value import Value, decode_value
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


def _do_reads(jobs: list[tuple[int, int, int]]) -> list[tuple[bytearray, int]]:
    """Blocking part of ``execute_reads``: one preadv per planned read, into one buffer each."""
    out: list[tuple[bytearray, int]] = []
    for fd, offset, total in jobs:
        buf = bytearray(total)
        got = os.preadv(fd, [buf], offset)
        while 0 < got < total:
            more = os.preadv(fd, [memoryview(buf)[got:]], offset + got)
            if more == 0:
                break
            got += more
        out.append((buf, got))
    return out


async def execute_reads(ctx: ReadContext) -> list[Value]:
    """Perform every planned read; returns the decoded value of every blob slot."""
    if not ctx.reads:
        return []
    engine = ctx.reads[0][0].engine
    jobs = [(r.file.fd, offset, total) for r, offset, total, _, _ in ctx.reads]
    results = await engine.run_sync(_do_reads, jobs)
    engine.stats.preadvs += len(jobs)
    values: list[Value] = []
    for (reader, offset, total, first, count), (buf, got) in zip(ctx.reads, results, strict=True):
        if got != total:
            raise LayerCorruptionError(reader.path, f"short read at {offset}: {got} of {total} bytes")
        engine.stats.bytes_read += got
        view = memoryview(buf)
        for slot in range(first, first + count):
            off, length, crc = ctx.blobs[slot]
            data = view[off - offset : off - offset + length]
            reader.check_blob(off, length, crc, data)
            values.append(decode_value(data))
    ctx.vectored_reads += len(jobs)
    ctx.blobs_read += len(values)
    ctx.reads.clear()
    ctx.blobs.clear()
    return values


async def read_and_resolve(ctx: ReadContext, states: Iterable[KeyState]) -> None:
    values = await execute_reads(ctx)
    for st in states:
        if st.pending is not None:
            st.resolve(values)


def _lsn_of(prefix: bytes) -> int:
    return int.from_bytes(prefix[KEY_SIZE:], "big")


def _range_end_prefix(key: Key, cont: int) -> bytes:
    """Prefix bound just past (key, cont - 1)."""
    if cont > MAX_LSN:
        return prefix_of(key_next(key), 0)
    return prefix_of(key, cont)


class PersistentLayer:
    """A delta layer file; also the base of ``ImageLayer``."""

    def __init__(self, desc: LayerDesc, reader: LayerFileReader) -> None:
        self.desc = desc
        self.reader = reader
        self.layer_id = next(_layer_ids)
        self.file_size = reader.summary.file_size

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
        r = self.reader
        ctx.layers_visited += 1
        # key -> [(lsn, offset, length, crc)], oldest first, from the newest will_init up.
        # Index order is (key, lsn) order is file order, so the plan comes out sorted by offset.
        planned: dict[Key, list[tuple[int, int, int, int, bool]]] = {}
        for first, last in key_runs(keys):
            for block, lo, hi in await r.scan(first + _ZERO_LSN, last + _ALL_LSNS_END):
                bkeys, lsns, positions = block.keys, block.lsns, block.positions
                lengths, crcs = block.lengths, block.crcs
                for i in range(lo, hi):
                    lsn = lsns[i]
                    if lsn < floor or lsn >= cont:
                        continue
                    key = bkeys[i]
                    st = states.get(key)
                    if st is None or st.complete or lsn <= st.cached_lsn:
                        continue
                    pos = positions[i]
                    blob = (lsn, pos >> 1, lengths[i], crcs[i], bool(pos & 1))
                    lst = planned.get(key)
                    if lst is None or pos & 1:
                        planned[key] = [blob]
                    else:
                        lst.append(blob)
        if not planned:
            self._finish_keys(keys, floor, states, ctx)
            return
        # Plan the reads: a read grows while the next blob starts where it ends (invariant 7).
        flat = [(key, blob) for key, lst in planned.items() for blob in lst]
        slot0 = len(ctx.blobs)
        ctx.blobs.extend((blob[1], blob[2], blob[3]) for _, blob in flat)
        max_bytes = ctx.max_vectored_read_bytes
        n = len(flat)
        i = 0
        while i < n:
            start_off = flat[i][1][1]
            end_off = start_off + flat[i][1][2]
            j = i + 1
            while j < n:
                off, length = flat[j][1][1], flat[j][1][2]
                if off != end_off or end_off + length - start_off > max_bytes:
                    break
                end_off += length
                j += 1
            r.check_entry(start_off, end_off - start_off)
            ctx.reads.append((r, start_off, end_off - start_off, slot0 + i, j - i))
            i = j
        # Hand the slots to the keys, newest first; will_init (from the index) completes.
        pos_in_flat = 0
        for key, lst in planned.items():
            st = states[key]
            base = pos_in_flat
            pos_in_flat += len(lst)
            for x in range(pos_in_flat - 1, base - 1, -1):
                if st.add_blob(Lsn(lst[x - base][0]), slot0 + x, flat[x][1][4]):
                    break
        self._finish_keys(keys, floor, states, ctx)

    def _finish_keys(
        self, keys: Sequence[Key], floor: int, states: dict[Key, KeyState], ctx: ReadContext
    ) -> None:
        # Keys whose cached page is at or above this layer's floor are done (PR #7477).
        if ctx.any_cached:
            for key in keys:
                states[key].floor_reached(floor)

    # -- whole-layer access (compaction, key collection) -----------------------------------

    async def iter_entries(self, batch_bytes: int = 1 << 20) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
        """Every (key, lsn, blob, will_init) in order; blobs read sequentially in big chunks."""
        r = self.reader
        for blkno in range(r.summary.n_index_blocks):
            block = await r.block(blkno)
            n = len(block.prefixes)
            i = 0
            while i < n:
                j = i
                start = block.positions[i] >> 1
                total = 0
                while j < n and total < batch_bytes:
                    total += block.lengths[j]
                    j += 1
                chunk = await r.read_blobs(start, [block.lengths[k] for k in range(i, j)])
                for k, data in zip(range(i, j), chunk, strict=True):
                    off = block.positions[k] >> 1
                    r.check_blob(off, block.lengths[k], block.crcs[k], data)
                    p = block.prefixes[k]
                    yield Key(p[:KEY_SIZE]), Lsn(_lsn_of(p)), bytes(data), bool(block.positions[k] & 1)
                i = j

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


# Above every (key, lsn) prefix of the same key: scanning [key + 0*8, key + this) covers all LSNs.
_ALL_LSNS_END = b"\xff" * 9
_ZERO_LSN = bytes(8)


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
    desc = LayerDesc(key_range, lsn_start, lsn_end, True)
    writer = await LayerFileWriter.create(engine, directory, desc, opts)
    try:
        async for key, lsn, blob, will_init in entries:
            await writer.put(key, lsn, blob, will_init)
    except BaseException:
        await writer.abort()
        raise
    if writer.n_entries == 0:
        await writer.abort()
        return None
    return await writer.finish()
