"""The two read paths over a timeline's layers: legacy per-key ``get`` and ``get_vectored``.

Both fill ``KeyState``s (records newest-first + maybe a base image); ``Timeline`` then
reconstructs, memorizes and (with ``validate_get``) compares them. Neither path does redo.

Legacy (storage.md §3.3), per key: ``cont_lsn = lsn + 1``; repeatedly read the newest layer
below ``cont_lsn`` (open in-memory layer, frozen ones newest first, then the layer map's
``search``) over ``[max(cached + 1, floor), cont_lsn)`` and lower ``cont_lsn`` to that floor,
until the key is complete; below the branch point continue on the ancestor.

Vectored (storage.md §3.4), for all keys at once: a walk newest-first with a *fringe* (a heap of
pending layer reads keyed by LSN range, highest first). Each step maps the still-unmapped keys
at ``cont_lsn`` to layers (one in-memory layer for all of them; ``LayerMap.search_span`` when
one persistent layer answers for all of them, the usual step, which skips the fringe; else
``range_search``), merging the key spaces of reads of the same layer and range so each layer is
read once for all keys routed to it; pops the highest read, runs it, and continues below its
floor with the keys it did not complete. Persistent layers are only *planned* from their
indexes (``PersistentLayer.plan_reads``: the will_init bit says where a key completes); all
their blob reads run together after the walk (``execute_reads``: one engine call per batch),
then values are decoded in walk order. A key leaves the walk at an image, a will_init record,
or when the walk's floor reaches its cached page (``KeyState.floor_reached``, the #7477 fix).
Keys no layer of this timeline holds go on to the ancestor, at ``min(lsn, ancestor_lsn) + 1``.
One key walks without fringe or key lists (``_walk_one``, ``PersistentLayer.plan_key``;
``get_one`` is the whole vectored read of one key). A walk
that finds the index cold prefetches the index blocks of the layers it may still visit
(``_prefetch_index``).

Mixed LSNs (``get_vectored_mixed``, the page service's scattered-lsn batches, neon#10765): the
same walk with a ``cont`` per key, so a batch whose keys have different request LSNs is one walk;
see the notes above ``_MixedFringe`` for when a layer is still visited twice.

Images in one layer (``read_images``, the page service's common batch): when one persistent
layer is the first the walk would visit for every key of a batch at one LSN (no in-memory layer
below the LSN, ``LayerMap.search_span`` of the keys' span), one call of the image kernel
(``_images_c.read_images``, twin ``_images_py``) searches its cached index, reads every key
whose newest version there is a page image and checks it: no key state, planned read or value
object per key. What it declines goes the general way (``Timeline.get_pages``).
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections.abc import Sequence
from typing import Any, Protocol

from pageserver.storage import _images_select, delta_layer
from pageserver.storage.delta_layer import (
    ALL_LSNS_END,
    ZERO_LSN,
    PersistentLayer,
    ReadContext,
    read_and_resolve,
)
from pageserver.storage.inmemory_layer import InMemoryLayer
from pageserver.storage.key import Key, KeyRange, is_inherited_key, key_hex, key_next
from pageserver.storage.layer_file import DATA_START
from pageserver.storage.layer_map import LayerMap
from pageserver.storage.reconstruct import KeyState
from protocol.lsn import MAX_LSN, Lsn

Layer = InMemoryLayer | PersistentLayer


class LayerStuckError(Exception):
    """The walk did not make progress (a layer-map inconsistency: a bug, not missing data)."""


class ReadableTimeline(Protocol):
    @property
    def layer_map(self) -> LayerMap: ...

    @property
    def ancestor_timeline(self) -> ReadableTimeline | None: ...

    @property
    def ancestor_lsn(self) -> Lsn: ...

    def in_memory_layers(self) -> Sequence[InMemoryLayer]:
        """Open layer first, then frozen layers newest first."""
        ...


def _first_in_memory(tl: ReadableTimeline, cont_lsn: int) -> InMemoryLayer | None:
    layers = tl.in_memory_layers()
    if not layers or layers[-1].start_lsn >= cont_lsn:
        return None  # the usual case once the walk is below the oldest in-memory layer
    for layer in layers:
        if layer.start_lsn < cont_lsn:
            return layer
    return None


async def get_legacy(tl: ReadableTimeline, key: Key, lsn: Lsn, state: KeyState) -> None:
    """Fill ``state`` for ``key`` at ``lsn``; leaves it incomplete if the key does not exist."""
    timeline: ReadableTimeline = tl
    cont_lsn = lsn + 1
    cached_floor = state.cached_lsn + 1 if state.cached_lsn >= 0 else 0
    while not state.complete:
        if cont_lsn <= cached_floor:
            state.complete = True
            break
        ancestor = timeline.ancestor_timeline
        if ancestor is not None and cont_lsn - 1 <= timeline.ancestor_lsn:
            if not is_inherited_key(key):
                return
            timeline = ancestor
            continue
        layer: Layer | None
        mem = _first_in_memory(timeline, cont_lsn)
        if mem is not None:
            layer = mem
            floor = max(cached_floor, mem.start_lsn)
        else:
            hit = timeline.layer_map.search(key, cont_lsn)
            if hit is None:
                if ancestor is None:
                    return
                cont_lsn = min(cont_lsn, timeline.ancestor_lsn + 1)
                continue
            layer, layer_floor = hit
            floor = max(cached_floor, layer_floor)
        await layer.get_value_legacy(key, floor, cont_lsn, state)
        if floor >= cont_lsn:
            raise LayerStuckError(f"read of {key_hex(key)} stuck at {cont_lsn:X} in {layer!r}")
        cont_lsn = floor


class _Fringe:
    """Pending layer reads, highest LSN range first; same (layer, range) reads are merged."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._reads: dict[tuple[int, int, int], tuple[Layer, list[Key]]] = {}

    def push(self, layer: Layer, keys: list[Key], floor: int, cont: int) -> None:
        ident = (id(layer), floor, cont)
        old = self._reads.get(ident)
        if old is not None:
            self._reads[ident] = (layer, sorted({*old[1], *keys}))
            return
        self._reads[ident] = (layer, keys)
        heapq.heappush(self._heap, (-cont, floor, id(layer)))

    def empty(self) -> bool:
        return not self._heap

    def pop(self) -> tuple[Layer, Sequence[Key], int, int] | None:
        if not self._heap:
            return None
        neg_cont, floor, ident = heapq.heappop(self._heap)
        layer, keys = self._reads.pop((ident, floor, -neg_cont))
        return layer, keys, floor, -neg_cont


def _pending(keys: Sequence[Key], states: dict[Key, KeyState], cont_lsn: int, cached: bool) -> list[Key]:
    """The keys still to be searched below ``cont_lsn`` (a cached page may finish some)."""
    if not cached:
        return [k for k in keys if not states[k].complete]
    out: list[Key] = []
    for key in keys:
        st = states[key]
        if not st.complete:
            st.floor_reached(cont_lsn)
            if not st.complete:
                out.append(key)
    return out


# A cold walk prefetches the index blocks of at most this many layers.
_PREFETCH_LAYERS = 64


def _prefetch_index(layer_map: LayerMap, first: Key, last: Key, cont_lsn: int) -> None:
    """The walk met an index block missing from the cache, so the index is cold: have the
    kernel fetch the blocks every layer it may still visit needs for ``[first, last]``."""
    start, end = first + ZERO_LSN, last + ALL_LSNS_END
    for layer in layer_map.read_candidates(first, last, cont_lsn, _PREFETCH_LAYERS):
        layer.reader.prefetch_index(start, end)


async def _walk_timeline(
    tl: ReadableTimeline,
    keys: list[Key],
    cont_lsn: int,
    states: dict[Key, KeyState],
    ctx: ReadContext,
) -> None:
    unmapped: Sequence[Key] = keys  # sorted, distinct, incomplete
    fringe = _Fringe()
    layer_map = tl.layer_map
    ctx.on_index_miss = functools.partial(_prefetch_index, layer_map, keys[0], keys[-1], cont_lsn)
    # The walk's LSN only goes down and in-memory layers only appear above the newest one
    # (a flush moves one into the layer map at the same LSNs): once none is below the walk's
    # LSN, none will be.
    in_memory = True
    cached = ctx.any_cached
    while True:
        if cached:
            unmapped = _pending(unmapped, states, cont_lsn, True)
        item: tuple[Layer, Sequence[Key], int, int] | None = None
        if unmapped:
            mem = _first_in_memory(tl, cont_lsn) if in_memory else None
            if mem is not None:
                item = (mem, unmapped, mem.start_lsn, cont_lsn)
            else:
                in_memory = False
                # The usual step (an L0 stack, or one key): one layer answers for every key.
                hit = layer_map.search_span(unmapped[0], unmapped[-1], cont_lsn)
                if hit is not None:
                    item = (hit[0], unmapped, hit[1], cont_lsn)
                else:
                    # One layer-map search for the span of all the keys: its answer is per key
                    # (the sub-ranges split at every layer boundary), so keys in the gaps cost
                    # nothing, and a batch of scattered blocks is one search, not one per run.
                    span = KeyRange(unmapped[0], key_next(unmapped[-1]))
                    found, _missing = layer_map.range_search(span, cont_lsn)
                    for hist, hist_floor, sub in found:
                        lo = bisect.bisect_left(unmapped, sub.start)
                        hi = bisect.bisect_left(unmapped, sub.end, lo)
                        if lo < hi:
                            fringe.push(hist, list(unmapped[lo:hi]), hist_floor, cont_lsn)
            if item is not None and not fringe.empty():
                # other reads are pending: order them all by LSN range
                fringe.push(item[0], list(item[1]), item[2], item[3])
                item = None
        if item is None:
            # (the usual step, one layer for every key, skips the fringe entirely)
            item = fringe.pop()
            if item is None:
                return
        layer, routed, floor, cont = item
        if cached:
            # a key sits in one fringe entry at a time, so only a cached page can have
            # finished it since it was routed here
            routed = _pending(routed, states, cont, True)
        if routed:
            if isinstance(layer, InMemoryLayer):
                await layer.get_values_vectored(routed, floor, cont, states, ctx)
                routed = [k for k in routed if not states[k].complete]
            elif len(routed) == 1:
                key = routed[0]
                st = states[key]
                if not layer.try_plan_key(key, floor, cont, st, ctx):
                    await layer.plan_key(key, floor, cont, st, ctx)
                if ctx.any_cached:
                    st.floor_reached(floor)
                if st.complete:
                    routed = ()
            else:
                # (the planning kernel finds the key runs itself; only a walk that must
                # read index blocks first, ``plan_reads``, makes the scan bounds)
                left = layer.try_plan(routed, floor, cont, states, ctx)
                if left is None:
                    left = await layer.plan_reads(routed, floor, cont, states, ctx)
                routed = left
        unmapped = routed
        cont_lsn = floor


async def _walk_one(tl: ReadableTimeline, key: Key, cont_lsn: int, st: KeyState, ctx: ReadContext) -> None:
    """``_walk_timeline`` for a single key (the page service's serial requests): layer by
    layer with ``LayerMap.search_span`` and ``PersistentLayer.plan_key``, no fringe, key lists or
    layer-map ranges; reads are still only planned, and done after the walk."""
    layer_map = tl.layer_map
    in_memory = True
    ctx.on_index_miss = functools.partial(_prefetch_index, layer_map, key, key, cont_lsn)
    while True:
        if ctx.any_cached:
            st.floor_reached(cont_lsn)
        if st.complete:
            return
        mem = _first_in_memory(tl, cont_lsn) if in_memory else None
        floor: int
        if mem is not None:
            floor = mem.start_lsn
            await mem.get_values_vectored((key,), floor, cont_lsn, {key: st}, ctx)
        else:
            in_memory = False
            hit = layer_map.search_span(key, key, cont_lsn)  # (= search, for one key)
            if hit is None:
                return
            layer, floor = hit
            if not layer.try_plan_key(key, floor, cont_lsn, st, ctx):
                await layer.plan_key(key, floor, cont_lsn, st, ctx)
        if floor >= cont_lsn:
            raise LayerStuckError(f"read of {key_hex(key)} stuck at {cont_lsn:X}")
        cont_lsn = floor


async def get_one(tl: ReadableTimeline, key: Key, lsn: Lsn, st: KeyState, ctx: ReadContext) -> None:
    """``get_vectored`` for one key (``Timeline.get_page``, the page service's lone requests):
    no key list, set or sort; ``_walk_one`` down this timeline and its ancestors, then the
    planned reads. Fills ``st`` exactly as ``get_vectored(tl, [key], lsn, {key: st}, ctx)``."""
    st.pending = []
    ctx.any_cached = st.cached_lsn >= 0
    timeline = tl
    cont_lsn = lsn + 1
    while not st.complete:
        await _walk_one(timeline, key, cont_lsn, st, ctx)
        ancestor = timeline.ancestor_timeline
        if ancestor is None or not is_inherited_key(key):
            break
        cont_lsn = min(cont_lsn, timeline.ancestor_lsn + 1)
        timeline = ancestor
    await read_and_resolve(ctx, (st,))


# the image kernel (a module attribute, so tests can put the twin in its place)
_read_images = _images_select.read_images
_read_images_into = _images_select.read_images_into


# How many layers down the image path follows keys a delta layer has nothing of (the walk's
# next steps): an image rewritten above an older one is found one layer down.
_IMAGE_DEPTH = 4


# Where ``read_images`` puts pages instead of bytes objects (the page service's response
# buffer): ``(out, dest, stride)``, key i's page at ``out[dest + i * stride:][:BLCKSZ]``.
Into = tuple[bytearray, int, int]


async def read_images(
    tl: ReadableTimeline, keys: Sequence[Key], lsn: Lsn, into: Into | None = None,
    slots: Sequence[int] | None = None,
) -> list[Any] | None:
    """The page of every key of ``keys`` (distinct) at ``lsn`` that the layer where the walk
    would find its newest version holds as an image (None in a declined key's place), or None
    when an in-memory layer is below ``lsn`` (the walk would visit it first), no persistent
    layer holds any of the keys, or the file system refuses ``RWF_NOWAIT``. A page given is
    what ``get_vectored`` finds for a key with nothing cached: its newest version below
    ``lsn + 1``, an image. With ``into``, key i's page is read into ``out`` at
    ``dest + slots[i] * stride`` (``slots`` default: i) and its entry is 1, not bytes.

    The keys are routed as the walk routes them: one layer for all of them
    (``LayerMap.search_span``), then, for the keys that layer has nothing of in its range (a
    delta layer: ``absent``), the layer below its floor, and so on, up to ``_IMAGE_DEPTH``
    layers; or, when the first step splits the keys over several layers (an image layer per
    key range), one call per layer of ``range_search`` and no step further. The caller keeps
    the layer files open meanwhile (a reader of the graveyard) and answers the declined keys
    with the general path."""
    if not keys or lsn >= MAX_LSN or not delta_layer._nowait[0]:
        return None
    cont = lsn + 1
    mem = tl.in_memory_layers()
    if mem and mem[-1].start_lsn < cont:  # the oldest: the walk would visit one first
        return None
    if into is not None and slots is None:
        slots = range(len(keys))
    layer_map = tl.layer_map
    first, last = min(keys), max(keys)
    hit = layer_map.search_span(first, last, cont)
    if hit is None:
        return await _images_split(layer_map, keys, first, last, cont, into, slots)
    layer, floor = hit
    got = await _images_in(layer, floor, keys, cont, into, slots)
    if got is None:
        return None
    pages, absent = got
    if 1 not in absent or layer.completes_keys:
        return pages  # the usual batch: every key answered (or declined) by its first layer
    # keys this delta layer has nothing of: the walk's next layers, all keys in each
    todo = [i for i, flag in enumerate(absent) if flag]
    for _ in range(_IMAGE_DEPTH - 1):
        cont = floor
        todo_keys = [keys[i] for i in todo]
        hit = layer_map.search_span(min(todo_keys), max(todo_keys), cont)
        if hit is None or hit[1] >= cont:
            break
        layer, floor = hit
        got = await _images_in(layer, floor, todo_keys, cont, into, None if slots is None else [slots[i] for i in todo])
        if got is None:
            break
        below, absent = got
        rest: list[int] = []
        for i, page, flag in zip(todo, below, absent, strict=True):
            if page:
                pages[i] = page
            elif flag and not layer.completes_keys:
                rest.append(i)
        if not rest:
            break
        todo = rest
    return pages


async def _images_split(
    layer_map: LayerMap, keys: Sequence[Key], first: Key, last: Key, cont: int, into: Into | None,
    slots: Sequence[int] | None,
) -> list[Any]:
    """``read_images``'s first step over several layers: per layer of ``range_search``, its keys
    in key order (keys a delta layer has nothing of are declined)."""
    found, _missing = layer_map.range_search(KeyRange(first, key_next(last)), cont)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    ordered = [keys[i] for i in order]
    out: list[Any] = [None] * len(keys)
    for layer, floor, sub in found:
        lo = bisect.bisect_left(ordered, sub.start)
        hi = bisect.bisect_left(ordered, sub.end, lo)
        if lo < hi:
            part = order[lo:hi]
            answer = await _images_in(layer, floor, ordered[lo:hi], cont, into,
                                      None if slots is None else [slots[i] for i in part])
            if answer is not None:
                for i, page in zip(part, answer[0], strict=True):
                    if page:
                        out[i] = page
    return out


async def _images_in(
    layer: PersistentLayer, floor: int, keys: Sequence[Key], cont: int, into: Into | None,
    slots: Sequence[int] | None,
) -> tuple[list[Any], bytes] | None:
    """One image-kernel call over ``layer``'s cached index and file: (pages, absent); with
    ``into``, 1 in place of a page read into its slot, else None."""
    if not layer.resident:
        return None
    r = layer.reader
    file = r.file
    if file.closed:
        return None  # (the general path raises LayerClosedError)
    summary = r.summary
    engine = file.engine
    if into is None:
        pages, absent, hits, calls, nbytes, supported = await engine.run_sync(
            _read_images, r.fences, summary.n_index_blocks, r.cache._blocks, r.file_id, keys, cont, floor,
            DATA_START, summary.data_end, file.fd,
        )
        values: list[Any] = pages
    else:
        placed, absent, hits, calls, nbytes, supported = await engine.run_sync(
            _read_images_into, r.fences, summary.n_index_blocks, r.cache._blocks, r.file_id, keys, cont,
            floor, DATA_START, summary.data_end, file.fd, into[0], into[1], into[2], slots,
        )
        values = [flag or None for flag in placed]
    r.cache.hits += hits
    engine.stats.preadvs += calls
    engine.stats.bytes_read += nbytes
    if not supported:
        delta_layer._nowait[0] = False
    return values, absent


async def get_vectored(
    tl: ReadableTimeline,
    keys: Sequence[Key],
    lsn: Lsn,
    states: dict[Key, KeyState],
    ctx: ReadContext,
) -> None:
    """Fill ``states`` (one per key, already seeded from the page cache) for ``keys`` at
    ``lsn``; keys that do not exist stay incomplete."""
    timeline: ReadableTimeline | None = tl
    cont_lsn = lsn + 1
    any_cached = False
    todo: set[Key] = set()
    for key in keys:
        st = states[key]
        st.pending = []
        if st.cached_lsn >= 0:
            any_cached = True
        if not st.complete:
            todo.add(key)
    ctx.any_cached = any_cached
    pending = sorted(todo)
    while pending and timeline is not None:
        if len(pending) == 1:
            await _walk_one(timeline, pending[0], cont_lsn, states[pending[0]], ctx)
        else:
            await _walk_timeline(timeline, pending, cont_lsn, states, ctx)
        if timeline.ancestor_timeline is None:
            break
        pending = [k for k in pending if not states[k].complete and is_inherited_key(k)]
        cont_lsn = min(cont_lsn, timeline.ancestor_lsn + 1)
        timeline = timeline.ancestor_timeline
    # The walk only planned the persistent layers' reads: do them all at once, then decode.
    await read_and_resolve(ctx, (states[k] for k in keys))


# -- mixed-LSN batches (the page service's scattered-lsn batching, neon#10765) -------------------
#
# Each key carries its own request LSN, so its own ``cont``. Reads are merged per (layer, floor,
# clip) where ``clip = min(cont, layer end)``: every key whose request LSN is at or above a
# layer's end sees the same values of it, so keys at different LSNs share one visit of it. A
# layer's reads take one ``cont`` for all their keys, so only keys whose LSN falls *inside* a
# persistent layer's LSN range cost a second visit of that layer. In-memory layers (where fresh
# request LSNs land while WAL is ingested) are read once with a per-key ``cont``.


def _layer_end(layer: Layer) -> int:
    if isinstance(layer, InMemoryLayer):
        return layer.lsn_end_or_max
    return int(layer.desc.lsn_end)


class _MixedFringe:
    """Pending layer reads, highest ``clip`` first; each key carries its own ``cont``."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []
        self._reads: dict[tuple[int, int, int], tuple[Layer, dict[Key, int]]] = {}

    def push(self, layer: Layer, keys: Sequence[Key], floor: int, conts: dict[Key, int]) -> None:
        end = _layer_end(layer)
        for key in keys:
            # an in-memory layer reads with per-key conts: one entry for all of them
            clip = end if isinstance(layer, InMemoryLayer) else min(conts[key], end)
            ident = (id(layer), floor, clip)
            entry = self._reads.get(ident)
            if entry is None:
                entry = self._reads[ident] = (layer, {})
                heapq.heappush(self._heap, (-clip, floor, id(layer)))
            entry[1][key] = conts[key]

    def pop(self) -> tuple[Layer, dict[Key, int], int, int] | None:
        if not self._heap:
            return None
        neg_clip, floor, ident = heapq.heappop(self._heap)
        layer, keys = self._reads.pop((ident, floor, -neg_clip))
        return layer, keys, floor, -neg_clip


def _pending_mixed(conts: dict[Key, int], states: dict[Key, KeyState], cached: bool) -> dict[Key, int]:
    out: dict[Key, int] = {}
    for key, cont in conts.items():
        st = states[key]
        if not st.complete and cached:
            st.floor_reached(cont)
        if not st.complete:
            out[key] = cont
    return out


async def _walk_timeline_mixed(
    tl: ReadableTimeline,
    conts: dict[Key, int],
    states: dict[Key, KeyState],
    ctx: ReadContext,
) -> None:
    unmapped = conts
    fringe = _MixedFringe()
    while True:
        unmapped = _pending_mixed(unmapped, states, ctx.any_cached)
        by_cont: dict[int, list[Key]] = {}
        for key, cont in unmapped.items():
            by_cont.setdefault(cont, []).append(key)
        for cont, keys in by_cont.items():
            keys.sort()
            mem = _first_in_memory(tl, cont)
            if mem is not None:
                fringe.push(mem, keys, mem.start_lsn, unmapped)
                continue
            start, end = keys[0], key_next(keys[-1])
            found, _missing = tl.layer_map.range_search(KeyRange(start, end), cont)
            for hist, hist_floor, sub in found:
                lo = bisect.bisect_left(keys, sub.start)
                hi = bisect.bisect_left(keys, sub.end, lo)
                if lo < hi:
                    fringe.push(hist, keys[lo:hi], hist_floor, unmapped)
        item = fringe.pop()
        if item is None:
            return
        layer, routed, floor, clip = item
        if ctx.any_cached:
            # a key sits in one fringe entry at a time: only its cached page can have finished
            # it since it was routed here
            routed = _pending_mixed(routed, states, True)
        if routed:
            if isinstance(layer, InMemoryLayer):
                await layer.get_values_bounded(sorted(routed.items()), floor, states, ctx)
            else:
                await layer.get_values_vectored(sorted(routed), floor, clip, states, ctx)
        unmapped = dict.fromkeys(routed, floor)


async def get_vectored_mixed(
    tl: ReadableTimeline,
    requests: dict[Key, Lsn],
    states: dict[Key, KeyState],
    ctx: ReadContext,
) -> None:
    """``get_vectored`` for keys at different LSNs (``requests``: key -> its LSN; one LSN per
    key) in one walk; each key only takes values at or below its own LSN."""
    timeline: ReadableTimeline | None = tl
    conts = {key: lsn + 1 for key, lsn in requests.items()}
    ctx.any_cached = any(states[k].cached_lsn >= 0 for k in requests)
    for key in requests:
        states[key].pending = []
    pending = {k: c for k, c in conts.items() if not states[k].complete}
    while pending and timeline is not None:
        await _walk_timeline_mixed(timeline, pending, states, ctx)
        if timeline.ancestor_timeline is None:
            break
        cap = timeline.ancestor_lsn + 1
        pending = {
            k: min(c, cap) for k, c in pending.items() if not states[k].complete and is_inherited_key(k)
        }
        timeline = timeline.ancestor_timeline
    await read_and_resolve(ctx, (states[k] for k in requests))
