"""Compaction: L0 deltas -> L1 deltas, and image layer creation (storage.md §2.7, §2.8).

``compact_level0``: once ``compaction_threshold`` L0s exist, merge all of them (they are
LSN-contiguous by construction) by (key, lsn) — a streaming k-way merge, blobs copied without
decoding, straight into the output files — into L1 files whose LSN range is the union of the
inputs, cut at key boundaries once a file holds ``compaction_target_size`` bytes. The new files
are made durable, then index_part lists them instead of the L0s, then the L0 files go (via the
graveyard). The merge works on lists: each input is read as ``iter_entry_batches`` (~1 MiB of
blobs, crc32c-checked), runs below the next input's head move as slices, and the output goes
to ``LayerFileWriter.put_many`` per ``MERGE_BATCH`` entries (byte for byte the files of a
``put`` per entry; about half the CPU per entry, docs/benchmarks.md "compaction").

``create_image_layers``: the timeline's keyspace at ``disk_consistent_lsn`` is split into
partitions of about ``compaction_target_size`` / 8 KiB keys (extended to tile the whole key
space, so together they cover everything); a partition whose delta stack above its newest image
has reached ``image_creation_threshold`` gets an image layer at ``disk_consistent_lsn``, built
with ``get_vectored`` in batches. Unless forced, the check runs only after 2 x
``checkpoint_distance`` of WAL since the last one. Image layers hold every key that exists in their range,
inherited ones included.

Concurrency: both run under the timeline's background lock (``Timeline.compact``), which keeps
other compactions and GC out, so the input layers stay listed and open while they are read.
The heavy part (reading inputs, writing and fsyncing outputs, opening them) runs WITHOUT the
layers lock, so WAL ingest keeps rolling and flushing L0s meanwhile; only the swap
(``_swap``: layer map, index_part, graveyard) takes it. Each works on a snapshot: the L0s
listed when it starts (new L0s start where the snapshot ends, so the L1s' LSN range ends
where they begin, and ``replace`` removes only the snapshot), and the ``disk_consistent_lsn``
when image creation starts (images are made at that LSN, however far flushes move it).
Cancelled or failed, a round deletes its outputs (shielded) and changes nothing; a crash
before the swap leaves files index_part does not list, which the next load deletes. A round
whose index_part write fails keeps its outputs on disk (closed, unlisted in memory): that
write may have failed after its rename, leaving an index_part that names them.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import trio

from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.image_layer import write_image_layer
from pageserver.storage.key import KEY_MAX, KEY_MIN, Key, KeyRange, is_inherited_key, key_next
from pageserver.storage.layer_file import LayerDesc, LayerFileWriter
from protocol.lsn import Lsn

if TYPE_CHECKING:
    from pageserver.timeline import Timeline

IMAGE_BATCH_KEYS = 256
MERGE_BATCH = 2048  # entries per LayerFileWriter.put_many of the L0 -> L1 merge
_KEYS_PER_PAGE = 8192


Entry = tuple[Key, Lsn, bytes, bool]


async def _merged(layers: list[PersistentLayer], out_size: int = 4096) -> AsyncIterator[list[Entry]]:
    """The entries of ``layers`` in (key, lsn) order, as lists of about ``out_size``: a k-way
    merge over each layer's ``iter_entry_batches``. The entries of the smallest source below
    the next source's head go over as one slice (a bulk load's L0s hold mostly different heap
    blocks, so runs are long); the heap moves once per run, not once per entry. No two
    sources share a (key, lsn): L0s hold disjoint LSN ranges."""
    sources = [x.iter_entry_batches() for x in layers]
    bufs: list[list[Entry]] = []
    heap: list[tuple[Key, Lsn, int]] = []
    for i, source in enumerate(sources):
        first = await anext(source, None)
        bufs.append(first or [])
        if first:
            heap.append((first[0][0], first[0][1], i))
    heapq.heapify(heap)
    pos = [0] * len(sources)
    out: list[Entry] = []
    while heap:
        i = heap[0][2]
        buf = bufs[i]
        p = pos[i]
        if len(heap) == 1:
            j = len(buf)
        else:
            nxt = heap[1] if len(heap) == 2 or heap[1] < heap[2] else heap[2]
            # (an entry compares with the (key, lsn) head by its key and LSN: never equal)
            j = bisect.bisect_left(buf, (nxt[0], nxt[1]), p)
        out += buf[p:j]
        if j == len(buf):
            more = await anext(sources[i], None)
            if not more:
                heapq.heappop(heap)
                bufs[i] = []
                continue
            bufs[i] = buf = more
            j = 0
        pos[i] = j
        heapq.heapreplace(heap, (buf[j][0], buf[j][1], i))
        if len(out) >= out_size:
            yield out
            out = []
    if out:
        yield out


async def _hook(tl: Timeline, point: str) -> None:
    """Test seam: lets a test hold a round at a known point (``Timeline.compaction_hook``)."""
    hook = tl.compaction_hook
    if hook is not None:
        await hook(point)


async def _discard(tl: Timeline, outputs: Sequence[PersistentLayer]) -> None:
    """Delete a failed or cancelled round's finished outputs; shielded, so a cancellation
    (shutdown) does not leave them behind."""
    with trio.CancelScope(shield=True):
        for done in outputs:
            await done.aclose()
            await tl.engine.unlink(done.path)  # the engine's way


async def _swap(
    tl: Timeline, remove: list[PersistentLayer], add: list[PersistentLayer]
) -> None:
    """The only part of a round under the layers lock. Cancelled before it holds the lock, it
    deletes ``add``. Once it holds it, it is shielded: the swap is short and must not stop
    between index_part and the layer map. index_part is written first and the layer map
    changed only once it is durable, so no read ever sees ``add`` unless it is listed.

    If index_part cannot be written, nothing changes and ``add`` is closed but its files are
    NOT deleted: a write that failed at its last step (the directory fsync) has already
    renamed an index_part that lists them, not ``remove``, into place, and a crash would make
    that the one a restart loads. The next load deletes whichever files its index_part does
    not list; a retried round writes the same names again (rename over them)."""
    try:
        await _hook(tl, "swap")
        await tl.layers_lock.acquire()
    except BaseException:
        await _discard(tl, add)
        raise
    try:
        with trio.CancelScope(shield=True):
            try:
                await tl.write_index_part(remove=remove, add=add)
            except BaseException:
                for done in add:
                    await done.aclose()
                raise
            tl.layer_map.replace(remove, add)
            tl.graveyard.bury(remove)
    finally:
        tl.layers_lock.release()


async def compact_level0(tl: Timeline) -> list[PersistentLayer]:
    """Returns the new L1 layers (empty if below the threshold). Caller holds the timeline's
    background lock, not its layers lock."""
    # The snapshot: L0s flushed from here on are not inputs and stay listed (replace removes
    # only these); they start at l0s[-1].lsn_end, where the L1s end.
    l0s = tl.layer_map.l0_layers()
    if len(l0s) < max(2, tl.config.compaction_threshold):
        return []
    lsn_start, lsn_end = l0s[0].desc.lsn_start, l0s[-1].desc.lsn_end
    target = tl.config.compaction_target_size
    # Streamed straight into the output files (no output held in memory); each file's final key
    # range, and so its name, is fixed when it is finished.
    provisional = LayerDesc(KeyRange.full(), lsn_start, lsn_end, True)
    outputs: list[PersistentLayer] = []
    writer: LayerFileWriter | None = None
    # Entries wait here and go to the writer with one ``put_many`` per MERGE_BATCH (the same
    # file as a ``put`` per entry, tests/pageserver/test_storage_compaction_batch.py); ``filled``
    # counts the file's bytes with theirs, so that a file is cut where the per-entry path would
    # cut it.
    runs: list[tuple[Key, int]] = []
    lsns: list[int] = []
    blobs: list[bytes] = []
    will_inits: list[bool] = []
    filled = 0
    last_key: Key | None = None

    async def drain(w: LayerFileWriter) -> None:
        if lsns:
            await w.put_many(runs, lsns, blobs, will_inits)
            runs.clear()
            lsns.clear()
            blobs.clear()
            will_inits.clear()

    try:
        async for batch in _merged(l0s):
            for key, lsn, blob, will_init in batch:
                if writer is not None and filled >= target and key != last_key:
                    await drain(writer)
                    outputs.append(await _finish_l1(tl, writer))
                    writer = None
                if writer is None:
                    writer = await LayerFileWriter.create(tl.engine, tl.path, provisional, tl.write_options())
                    await writer.put(key, lsn, blob, will_init)
                    last_key = key
                    filled = len(blob)
                    await _hook(tl, "l0_merge")
                    continue
                if key == last_key and runs:
                    runs[-1] = (key, runs[-1][1] + 1)
                else:
                    runs.append((key, 1))
                    last_key = key
                lsns.append(lsn)
                blobs.append(blob)
                will_inits.append(will_init)
                filled += len(blob)
                if len(lsns) >= MERGE_BATCH:
                    await drain(writer)
        if writer is not None:
            await drain(writer)
            outputs.append(await _finish_l1(tl, writer))
            writer = None
    except BaseException:
        if writer is not None:
            with trio.CancelScope(shield=True):
                await writer.abort()
        await _discard(tl, outputs)
        raise
    await _swap(tl, l0s, outputs)
    return outputs


async def _finish_l1(tl: Timeline, writer: LayerFileWriter) -> PersistentLayer:
    first, last = writer.first_key, writer.last_key
    assert first is not None and last is not None
    path = await writer.finish(KeyRange(first, key_next(last)))
    return await PersistentLayer.open(tl.engine, path, tl.index_cache)


async def collect_keys(tl: Timeline, lsn: Lsn) -> set[Key]:
    """Every key that exists at ``lsn`` on ``tl``, inherited ones included."""
    keys: set[Key] = set()
    for layer in list(tl.layer_map):  # the awaits below may see flushes change the map
        if layer.desc.lsn_start > lsn:
            continue
        async for key, entry_lsn, _len in layer.iter_index():
            if entry_lsn <= lsn:
                keys.add(key)
    for mem in tl.in_memory_layers():
        if mem.start_lsn > lsn:
            continue
        for key, entries in mem.index.items():
            if entries[0] <= lsn:
                keys.add(key)
    if tl.ancestor is not None:
        inherited = await collect_keys(tl.ancestor, Lsn(min(lsn, tl.ancestor_lsn)))
        keys.update(k for k in inherited if is_inherited_key(k))
    return keys


def partition_keys(keys: list[Key], target_size: int) -> list[tuple[KeyRange, list[Key]]]:
    """Sorted keys -> partitions tiling [KEY_MIN, KEY_MAX)."""
    per_part = max(1, target_size // _KEYS_PER_PAGE)
    parts: list[tuple[KeyRange, list[Key]]] = []
    start = KEY_MIN
    for i in range(0, len(keys), per_part):
        chunk = keys[i : i + per_part]
        end = KEY_MAX if i + per_part >= len(keys) else keys[i + per_part]
        parts.append((KeyRange(start, end), chunk))
        start = end
    return parts


# Neon's image_layer_creation_check_threshold: look for work only every 2 checkpoint_distances
# of WAL (finding the keyspace scans every layer index).
IMAGE_CHECK_DISTANCES = 2


async def create_image_layers(tl: Timeline, *, force: bool = False) -> list[PersistentLayer]:
    """Caller holds the timeline's background lock, not its layers lock."""
    # The snapshot LSN: flushes move disk_consistent_lsn on while this runs; everything at or
    # below this one stays in layer files that only this round's swap (or GC, kept out by the
    # background lock) could remove.
    lsn = tl.disk_consistent_lsn
    if lsn <= 0 or lsn < tl.latest_gc_cutoff_lsn:
        return []
    if not force and lsn - tl.last_image_check_lsn < IMAGE_CHECK_DISTANCES * tl.config.checkpoint_distance:
        return []
    # The ancestor's layers are not ours to keep: count as a reader, so a compaction or GC of
    # the ancestor cannot close a layer this scan is reading (the graveyard is per tenant).
    tl.graveyard.readers += 1
    try:
        if tl.graveyard.evicted:
            # the scan reads every layer's index: all of them on local disk first
            await tl.ensure_resident(tl.layers_needed({KEY_MIN: lsn, KEY_MAX: lsn}, all_keys=True))
        keys = sorted(await collect_keys(tl, lsn))
    finally:
        tl.graveyard.readers -= 1
    created: list[PersistentLayer] = []
    try:
        for key_range, part_keys in partition_keys(keys, tl.config.compaction_target_size):
            # New L0s flushed meanwhile start above ``lsn``: they only add to the count.
            newest = tl.layer_map.newest_image_covering(key_range, lsn)
            newest_lsn = newest.desc.image_lsn if newest is not None else -1
            if newest_lsn == lsn:
                continue
            if not force and tl.layer_map.count_deltas_above(key_range, newest_lsn) < tl.config.image_creation_threshold:
                continue
            await _hook(tl, "image")

            async def images(ks: list[Key] = part_keys) -> AsyncIterator[tuple[Key, bytes]]:
                for i in range(0, len(ks), IMAGE_BATCH_KEYS):
                    batch = ks[i : i + IMAGE_BATCH_KEYS]
                    pages = await tl.get_vectored(batch, lsn)
                    for key in batch:
                        yield key, pages[key]

            path = await write_image_layer(
                tl.engine, tl.path, key_range, lsn, images(), opts=tl.write_options()
            )
            if path is not None:
                try:
                    layer = await PersistentLayer.open(tl.engine, path, tl.index_cache)
                except BaseException:
                    with trio.CancelScope(shield=True):
                        await tl.engine.unlink(path)
                    raise
                created.append(layer)
    except BaseException:
        await _discard(tl, created)
        raise
    if created:
        await _swap(tl, [], created)
    tl.last_image_check_lsn = lsn
    return created
