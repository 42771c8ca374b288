"""The in-memory layer: recent writes of a timeline, backed by an ephemeral file.

Values are appended (encoded) to an ``EphemeralFile`` (buffered and optionally
double-buffered); the index keeps, per key, one ``array('Q')`` of flat triples
``(lsn, offset << 1 | will_init, length)``. So the Python-object cost is per *key* (a dict slot
and one array), never per value: 256 MiB of small values over few keys costs 24 bytes per value
in array memory (issue 3's memory goal). Writes arrive in LSN order, so each key's triples are
sorted by LSN; a second put of the same key at the same LSN replaces the first.

Freezing sets ``end_lsn`` and stops appends; ``write_l0`` streams the frozen layer into an L0
delta layer file in (key, lsn) order: the packing kernel (``_l0_c.pack_values``, twin
``_l0_py``) cuts the values out of the ephemeral file's bytes (read whole up to 64 MiB, mapped
beyond) and makes their index entries, a piece of at most 8 MiB of values per call, which
``LayerFileWriter.put_packed`` takes whole. ``_entries`` is the same data one value at a time
(the oracle the packed path is tested against).
"""

from __future__ import annotations

import mmap
import time
from array import array
from collections.abc import AsyncIterator, Iterable, Sequence
from itertools import islice, repeat
from pathlib import Path
from typing import Protocol, cast

from pageserver.storage import _l0_select
from pageserver.storage.delta_layer import ReadContext
from pageserver.storage.ephemeral_file import EphemeralFile
from pageserver.storage.io_engine import IoEngine
from pageserver.storage.key import Key, KeyRange
from pageserver.storage.layer_file import LayerDesc, LayerFileWriter, WriteOptions, write_layer_file
from pageserver.storage.reconstruct import KeyState
from pageserver.storage.value import decode_value
from protocol.lsn import MAX_LSN, Lsn
from protocol.wal.ingest_kernel import append_triples

# A frozen layer of at most this many bytes is read whole for its flush; a bigger one is mapped.
_READ_WHOLE_MAX = 64 * 1024 * 1024
# Values read per engine call by ``_entries`` (the per-value view) of a big layer.
_READ_BATCH = 2048
# Bytes of values per packing call of ``write_l0`` (one writer call each; bounds the flush's
# memory besides the index).
_PACK_BYTES = 8 * 1024 * 1024
# the L0 packing kernel (a module attribute, so tests can put the twin in its place)
_pack_values = _l0_select.pack_values

# ``try_put_mixed``'s items: a value (key, lsn, blob, will_init), a run of values of one key
# (key, lsns, head, raws, will_init), or a packed run of values of one key and one length
# (key, lsns, blob, at, vlen, will_init): value v is blob[at + v * vlen : at + (v + 1) * vlen]
# (the ingest kernel's ``fused_walk``)
PutItem = (
    tuple[Key, int, bytes, bool]
    | tuple[Key, range, bytes, Sequence[bytes], bool]
    | tuple[Key, "array[int]", bytes, int, int, bool]
)


def _run_entries(index: dict[Key, array[int]], key: Key, lsn: int) -> array[int] | None:
    """The index array a run of ``key``'s values from ``lsn`` on is appended to (a new one for
    a new key), or ``None`` when ``lsn`` is not above the key's last entry: a replace, or
    below an earlier put, which ``put`` does or refuses. (The index's own array: entries
    appended earlier in the same ``try_put_mixed`` count.)"""
    found = index.get(key)
    if found is None:
        found = index[key] = array("Q")
    elif lsn <= found[-3]:
        return None
    return found


# An in-memory layer's index as ``write_l0`` packs it: the keys sorted and joined, the number of
# values per key, every value's (lsn, offset << 1 | will_init, length) in that key order.
FlatIndex = tuple[bytes, "array[int]", "array[int]"]


def flat_index(index: dict[Key, array[int]]) -> FlatIndex:
    """``index`` flattened in key order (C copies per key)."""
    keys = sorted(index)
    counts = array("Q", [len(index[key]) // 3 for key in keys])
    triples: array[int] = array("Q")
    for key in keys:
        triples += index[key]
    return b"".join(keys), counts, triples


class FrozenData(Protocol):
    """What ``write_l0`` reads of a frozen layer's data: an ``EphemeralFile``, or, in the L0
    worker process (``l0_worker``), the same file opened read-only."""

    @property
    def length(self) -> int: ...

    async def read_all(self) -> bytes: ...

    async def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]: ...

    def mapped(self) -> mmap.mmap | None:
        """The data mapped read-only (the caller closes it), or ``None`` while part of it is
        still in a write buffer (then ``read_all`` has it all)."""


class InMemoryLayer:
    def __init__(self, file: EphemeralFile, start_lsn: Lsn) -> None:
        self.file = file
        self.start_lsn = start_lsn
        self.end_lsn: Lsn | None = None  # exclusive; set by freeze
        self.max_lsn: Lsn | None = None
        self.index: dict[Key, array[int]] = {}
        self.opened_at = time.monotonic()
        # the index already flat (``frozen_view``), for ``write_l0``
        self._flat: FlatIndex | None = None

    @classmethod
    def frozen_view(cls, data: FrozenData, index: FlatIndex, start_lsn: Lsn, end_lsn: Lsn) -> InMemoryLayer:
        """A frozen layer over ``data`` and the flat ``index`` that is only good for
        ``write_l0`` (the L0 worker process rebuilds the pageserver's frozen layer this way,
        so that it writes with the very same code: ``size`` and ``write_l0`` only read
        ``length``, ``read_all`` and ``mapped``)."""
        layer = cls(cast(EphemeralFile, data), start_lsn)
        layer._flat = index
        layer.end_lsn = end_lsn
        return layer

    @property
    def size(self) -> int:
        return self.file.length

    @property
    def lsn_end_or_max(self) -> int:
        return self.end_lsn if self.end_lsn is not None else MAX_LSN + 1

    def __repr__(self) -> str:
        return f"<InMemoryLayer {self.start_lsn:X}-{self.end_lsn or 0:X}>"

    async def put(self, key: Key, lsn: Lsn, blob: bytes, will_init: bool) -> None:
        if self.end_lsn is not None:
            raise AssertionError("put into a frozen in-memory layer")
        # (the timeline's put lock keeps freezing out until the index entry below is in)
        if lsn < self.start_lsn:
            raise ValueError(f"put at {lsn:X} below the layer start {self.start_lsn:X}")
        self._index_put(key, lsn, await self.file.append(blob), len(blob), will_init)

    def try_put(
        self, key: Key, lsn: Lsn, blob: bytes, will_init: bool, max_size: int = 1 << 62
    ) -> bool:
        """``put`` without an await when the blob fits in the write buffer and the layer stays
        within ``max_size`` bytes (the WAL ingest hot path: no task switch can come between
        the append and the index entry, so no lock is needed); ``False`` if nothing was
        written and ``put`` must be used."""
        if self.end_lsn is not None or lsn < self.start_lsn:
            return False
        offset = self.file.try_append(blob, max_size)
        if offset < 0:
            return False
        self._index_put(key, lsn, offset, len(blob), will_init)
        return True

    def try_put_mixed(
        self, items: Sequence[PutItem], start: int, sub: int = 0, max_size: int = 1 << 62
    ) -> tuple[int, int]:
        """``try_put`` of ``items`` (in LSN order) as long as they fit in the write buffer: one
        append of the joined blobs, index entries without a call per value. Items are single
        values ``(key, lsn, blob, will_init)`` or runs ``(key, lsns, head, raws, will_init)``: the values ``head + raws[v]`` at
        ``(key, lsns[v])``, one key, LSNs rising (a ``range``), raws all of one length (a bulk
        load's INSERTs into one heap page, ``WalIngest.ingest_decoder``), from value ``sub``
        of ``items[start]`` on. The same file bytes and index entries as ``try_put`` of
        those values one by one, but a run costs no tuple and no loop iteration per value: its
        index triples come from list slice assignments, its bytes from one ``join``. Returns
        ``(i, v)``: the first value not put is value ``v`` of ``items[i]`` (0 for a single
        value); the caller puts it the slow way (``put``), which also reports any error."""
        n = len(items)
        if self.end_lsn is not None or start >= n:
            return start, sub
        item = items[start]
        if len(item) != 4 and not item[1]:
            raise ValueError("a run needs one rising LSN per value and raws of one length")
        if (item[1] if len(item) == 4 else item[1][sub]) < self.start_lsn:
            return start, sub
        file = self.file
        offset = base = file.length
        limit = base + file.room(max_size)
        index = self.index
        pieces: list[bytes | memoryview] = []
        add_piece = pieces.append
        last_key: Key | None = None
        entries: array[int] = array("Q")
        append = entries.append
        last_lsn = 0  # of last_key in the index
        i, v = start, sub
        for item in islice(items, start, None):
            if len(item) == 4:
                key, lsn, blob, will_init = item
                end = offset + len(blob)
                if end > limit:
                    break
                if key != last_key:
                    found = index.get(key)
                    if found is None:
                        found = index[key] = array("Q")
                        last_lsn = -1
                    else:
                        last_lsn = found[-3]
                    entries = found
                    append = entries.append
                    last_key = key
                if lsn > last_lsn:
                    append(lsn)
                    append((offset << 1) | will_init)
                    append(end - offset)
                    last_lsn = lsn
                elif lsn == last_lsn:
                    entries[-2] = (offset << 1) | will_init
                    entries[-1] = end - offset
                else:
                    break  # below an earlier put: put() raises
                add_piece(blob)
                offset = end
                i += 1
                continue
            # a run of one key's values: packed by the walk kernel (key, ends, packed, first,
            # vlen, will_init) or collected by the in-page loop (key, lsns, head, raws,
            # will_init); the values from ``v`` on that fit go in, their index entries
            # appended to the key's array (``_run_entries``)
            if len(item) == 6:
                key, ends, packed, first, vlen, will_init = item
                m = len(ends)
                count = min(m - v, (limit - offset) // vlen)
                if count <= 0:
                    break
                stop = v + count
                found = _run_entries(index, key, ends[v])
                if found is None:
                    break
                append_triples(found, ends, v, stop, offset, vlen, will_init)
                add_piece(memoryview(packed)[first + v * vlen : first + stop * vlen])
                run_last = ends[stop - 1]
            else:
                key, lsns, head, raws, will_init = item
                m = len(raws)
                if not m or len(lsns) != m or not isinstance(lsns, range) or lsns.step <= 0:
                    raise ValueError("a run needs one rising LSN per value and raws of one length")
                size = len(raws[0])
                vlen = len(head) + size
                count = min(m - v, (limit - offset) // vlen) if vlen else m - v
                if count <= 0:
                    break
                stop = v + count
                joined = head.join(raws[v:stop] if v or stop < m else raws)
                if len(joined) != count * vlen - len(head):
                    raise ValueError("a run needs one rising LSN per value and raws of one length")
                found = _run_entries(index, key, lsns[v])
                if found is None:
                    break
                # the triples (lsn, offset << 1 | will_init, length) by slice assignments into
                # a list (the cheapest interleave measured: ~0.07 µs per value)
                triples = [vlen] * (3 * count)
                triples[0::3] = lsns[v:stop]
                at = (offset << 1) | will_init
                step = vlen << 1
                triples[1::3] = range(at, at + count * step, step) if vlen else [at] * count
                found.fromlist(triples)
                add_piece(head)
                add_piece(joined)
                run_last = lsns[stop - 1]
            entries = found
            append = entries.append
            last_key = key
            last_lsn = run_last
            offset += count * vlen
            if stop < m:
                v = stop
                break
            i += 1
            v = 0
        if i == start and v == sub:
            return start, sub
        # No await since the room was measured: the append cannot decline.
        data = b"".join(pieces)
        at = file.try_append(data, max_size) if data else base
        if at != base:
            raise AssertionError(f"in-memory layer append at {at}, expected {base}")
        item = items[i - 1] if v == 0 else items[i]
        lsn = item[1] if len(item) == 4 else item[1][v - 1]
        if self.max_lsn is None or lsn > self.max_lsn:
            self.max_lsn = Lsn(lsn)
        return i, v

    def _index_put(self, key: Key, lsn: Lsn, offset: int, size: int, will_init: bool) -> None:
        entries = self.index.get(key)
        if entries is None:
            self.index[key] = array("Q", (lsn, (offset << 1) | will_init, size))
        elif entries[-3] == lsn:
            entries[-2] = (offset << 1) | will_init
            entries[-1] = size
        elif entries[-3] > lsn:
            raise ValueError(f"put at {lsn:X} below an earlier put of the same key")
        else:
            entries.extend((lsn, (offset << 1) | will_init, size))
        if self.max_lsn is None or lsn > self.max_lsn:
            self.max_lsn = lsn

    async def freeze(self, end_lsn: Lsn) -> None:
        self.end_lsn = end_lsn
        await self.file.freeze()

    async def aclose(self) -> None:
        await self.file.aclose()

    # -- reads ----------------------------------------------------------------------------

    async def get_value_legacy(self, key: Key, floor: int, cont: int, state: KeyState) -> None:
        entries = self.index.get(key)
        if entries is None:
            return
        for i in range(len(entries) - 3, -1, -3):
            lsn = entries[i]
            if lsn >= cont:
                continue
            if lsn < floor:
                break
            pos, length = entries[i + 1], entries[i + 2]
            blob = await self.file.read_at(pos >> 1, length)
            if state.add(Lsn(lsn), decode_value(blob)):
                break

    async def get_values_vectored(
        self,
        keys: Sequence[Key],
        floor: int,
        cont: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> None:
        await self.get_values_bounded(zip(keys, repeat(cont)), floor, states, ctx)

    async def get_values_bounded(
        self,
        bounds: Iterable[tuple[Key, int]],
        floor: int,
        states: dict[Key, KeyState],
        ctx: ReadContext,
    ) -> None:
        """Read each ``(key, cont)`` of ``bounds`` in ``[floor, cont)``: a per-key upper LSN
        bound (exclusive), one layer visit for all of them."""
        ctx.layers_visited += 1
        index = self.index
        for key, cont in bounds:
            st = states[key]
            entries = index.get(key)
            if entries is not None and not st.complete:
                for i in range(len(entries) - 3, -1, -3):
                    lsn = entries[i]
                    if lsn >= cont:
                        continue
                    if lsn < floor:
                        break
                    pos, length = entries[i + 1], entries[i + 2]
                    blob = await self.file.read_at(pos >> 1, length)
                    ctx.blobs_read += 1
                    if st.add(Lsn(lsn), decode_value(blob)):
                        break
            st.floor_reached(floor)

    # -- flush ----------------------------------------------------------------------------

    async def _entries(self) -> AsyncIterator[tuple[Key, Lsn, bytes | bytearray | memoryview, bool]]:
        # A small frozen file is read once, whole, then sliced per value: one big sequential
        # read instead of a syscall per value. A big one is read per value, so a flush never
        # holds a whole checkpoint_distance of data in memory (issue 3's RSS goal).
        # Values are cut out as bytes: for values of a few hundred bytes a copy costs less
        # than a memoryview object.
        if self.size <= _READ_WHOLE_MAX:
            data = await self.file.read_all()
            for key in sorted(self.index):
                entries = self.index[key]
                for i in range(0, len(entries), 3):
                    pos, length = entries[i + 1], entries[i + 2]
                    off = pos >> 1
                    yield key, Lsn(entries[i]), data[off : off + length], pos & 1 == 1
            return
        # A big one: _READ_BATCH values per read_many (one engine call; a read_at per value
        # cost a coroutine stack and an engine call each, several seconds per GiB of WAL), and
        # values that sit back to back in the file (a key's successive records usually do)
        # read as one range: a pread per run instead of per value. Each value remembers its
        # run and where in it it starts; the values are cut out right here (a nested async
        # generator per batch cost a second async-generator step per value).
        batch: list[tuple[Key, int, int, int, int, int]] = []  # key, lsn, pos, length, run, at
        ranges: list[tuple[int, int]] = []
        run_start = run_end = -1
        keys = sorted(self.index)
        last = len(keys) - 1
        for k, key in enumerate(keys):
            entries = self.index[key]
            for i in range(0, len(entries), 3):
                pos = entries[i + 1]
                off = pos >> 1
                if off != run_end:
                    if run_end >= 0:
                        ranges.append((run_start, run_end - run_start))
                    run_start = off
                length = entries[i + 2]
                run_end = off + length
                batch.append((key, entries[i], pos, length, len(ranges), off - run_start))
            if batch and (len(batch) >= _READ_BATCH or k == last):
                ranges.append((run_start, run_end - run_start))
                runs = await self.file.read_many(ranges)
                for bkey, lsn, pos, length, run, at in batch:
                    yield bkey, Lsn(lsn), runs[run][at : at + length], pos & 1 == 1
                batch = []
                ranges = []
                run_start = run_end = -1

    async def write_l0(self, engine: IoEngine, directory: Path, opts: WriteOptions) -> Path | None:
        """Write the frozen layer to an L0 delta layer file; None if it holds no value.

        The keys are sorted once and the index arrays joined in that order (per key, C
        copies); the packing kernel (``_l0_select.pack_values``, run by the IO engine: the
        compiled one without the GIL) then cuts the values out of the layer's bytes and makes
        their index entries, ``_PACK_BYTES`` of values per call, and the writer takes each
        piece whole (``LayerFileWriter.put_packed``). The layer's bytes: read whole when at most
        ``_READ_WHOLE_MAX``, else the file mapped read-only (its pages dropped from this
        process's mapping after each piece: a flush never holds a ``checkpoint_distance`` of
        it in memory; the page cache has it either way)."""
        if self.end_lsn is None:
            raise AssertionError("only a frozen in-memory layer is written to disk")
        joined, counts, triples = self._flat if self._flat is not None else flat_index(self.index)
        lsn_start, lsn_end = self.start_lsn, self.end_lsn
        n_keys = len(counts)

        async def fill(writer: LayerFileWriter) -> None:
            if not n_keys:
                return
            mapped = self.file.mapped() if self.size > _READ_WHOLE_MAX else None
            src = mapped if mapped is not None else await self.file.read_all()
            try:
                key_at = sub = 0
                while key_at < n_keys:
                    data, entries, key_at, sub = await engine.run_sync(
                        _pack_values, joined, counts, triples, src, key_at, sub,
                        writer.next_offset, _PACK_BYTES, lsn_start, lsn_end,
                    )
                    await writer.put_packed(data, entries)
                    if mapped is not None:
                        mapped.madvise(mmap.MADV_DONTNEED)
            finally:
                if mapped is not None:
                    mapped.close()

        # (the values' lengths add up to the data section: the index goes straight behind it)
        data_size = sum(triples[2::3])
        if data_size > self.size:
            # (the L0 worker's index comes off a pipe: lengths that cannot be the layer's
            # would place the index far behind the data in a huge sparse file before the
            # kernel refuses a value)
            raise ValueError(
                f"write_l0: the index's values add up to {data_size} bytes, the layer holds {self.size}"
            )
        return await write_layer_file(engine, directory, self.l0_desc(), opts, fill, data_size=data_size)

    def l0_desc(self) -> LayerDesc:
        """What the frozen layer's L0 covers (its file name: the L0 worker's answer must name
        exactly that file in the timeline directory)."""
        if self.end_lsn is None:
            raise AssertionError("only a frozen in-memory layer has an L0")
        return LayerDesc(KeyRange.full(), self.start_lsn, self.end_lsn, True)
