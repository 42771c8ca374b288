"""Compaction: L0 deltas -> L1 deltas, and image layer creation (storage.md §2.7, §2.8).

``compact_level0``: once ``compaction_threshold`` L0s exist, merge all of them (they are
LSN-contiguous by construction) by (key, lsn) — a streaming k-way merge, blobs copied without
decoding, straight into the output files — into L1 files whose LSN range is the union of the
inputs, cut at key boundaries once a file holds ``compaction_target_size`` bytes. The new files are made durable, then
index_part lists them instead of the L0s, then the L0 files go (via the graveyard).

``create_image_layers``: the timeline's keyspace at ``disk_consistent_lsn`` is split into
partitions of about ``compaction_target_size`` / 8 KiB keys (extended to tile the whole key
space, so together they cover everything); a partition whose delta stack above its newest image
has reached ``image_creation_threshold`` gets an image layer at ``disk_consistent_lsn``, built
with ``get_vectored`` in batches. Unless forced, the check runs only after 2 x
``checkpoint_distance`` of WAL since the last one. Image layers hold every key that exists in their range,
inherited ones included.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.image_layer import write_image_layer
from pageserver.storage.key import KEY_MAX, KEY_MIN, Key, KeyRange, is_inherited_key, key_next
from pageserver.storage.layer_file import LayerDesc, LayerFileWriter
from protocol.lsn import Lsn

if TYPE_CHECKING:
    from pageserver.timeline import Timeline

IMAGE_BATCH_KEYS = 256
_KEYS_PER_PAGE = 8192


async def _merged(
    layers: list[PersistentLayer],
) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
    iters = [x.iter_entries() for x in layers]
    heap: list[tuple[Key, Lsn, int, bytes, bool]] = []
    for i, it in enumerate(iters):
        async for key, lsn, blob, will_init in it:
            heap.append((key, lsn, i, blob, will_init))
            break
    heapq.heapify(heap)
    while heap:
        key, lsn, i, blob, will_init = heap[0]
        yield key, lsn, blob, will_init
        nxt = None
        async for entry in iters[i]:
            nxt = entry
            break
        if nxt is None:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (nxt[0], nxt[1], i, nxt[2], nxt[3]))


async def compact_level0(tl: Timeline) -> list[PersistentLayer]:
    """Returns the new L1 layers (empty if below the threshold)."""
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
    try:
        async for key, lsn, blob, will_init in _merged(l0s):
            if writer is not None and writer.data_size >= target and key != writer.last_key:
                outputs.append(await _finish_l1(tl, writer))
                writer = None
            if writer is None:
                writer = await LayerFileWriter.create(tl.engine, tl.path, provisional, tl.write_options())
            await writer.put(key, lsn, blob, will_init)
        if writer is not None:
            outputs.append(await _finish_l1(tl, writer))
            writer = None
    except BaseException:
        if writer is not None:
            await writer.abort()
        for done in outputs:
            await done.aclose()
            await tl.engine.run_sync(os.unlink, done.path)  # the engine's way, like every file op
        raise
    tl.layer_map.replace(l0s, outputs)
    await tl.write_index_part()
    tl.graveyard.bury(l0s)
    return outputs


async def _finish_l1(tl: Timeline, writer: LayerFileWriter) -> PersistentLayer:
    first, last = writer.first_key, writer.last_key
    assert first is not None and last is not None
    path = await writer.finish(KeyRange(first, key_next(last)))
    return await PersistentLayer.open(tl.engine, path, tl.index_cache)


async def collect_keys(tl: Timeline, lsn: Lsn) -> set[Key]:
    """Every key that exists at ``lsn`` on ``tl``, inherited ones included."""
    keys: set[Key] = set()
    for layer in tl.layer_map:
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
    lsn = tl.disk_consistent_lsn
    if lsn <= 0 or lsn < tl.latest_gc_cutoff_lsn:
        return []
    if not force and lsn - tl.last_image_check_lsn < IMAGE_CHECK_DISTANCES * tl.config.checkpoint_distance:
        return []
    keys = sorted(await collect_keys(tl, lsn))
    created: list[PersistentLayer] = []
    for key_range, part_keys in partition_keys(keys, tl.config.compaction_target_size):
        newest = tl.layer_map.newest_image_covering(key_range, lsn)
        newest_lsn = newest.desc.image_lsn if newest is not None else -1
        if newest_lsn == lsn:
            continue
        if not force and tl.layer_map.count_deltas_above(key_range, newest_lsn) < tl.config.image_creation_threshold:
            continue

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
            layer = await PersistentLayer.open(tl.engine, path, tl.index_cache)
            tl.layer_map.replace([], [layer])
            created.append(layer)
    if created:
        await tl.write_index_part()
    tl.last_image_check_lsn = lsn
    return created
