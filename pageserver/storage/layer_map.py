"""The layer map: which historic layer to read next for (key range, LSN) (storage.md §2.6).

Neon keeps persistent coverage trees snapshotted per ``lsn.start``; pagestore keeps the
historic layers in one list sorted by ``lsn_end`` descending, so "the layer with the highest
``lsn_end`` among those with ``lsn_start < end_lsn`` covering the key" is the first match of a
scan (layers near the top of the LSN range are found after a few steps). ``select_layer``
follows Neon's rule exactly: prefer the image when it is newer than the delta or an exact match,
else read the delta clamped to just above the image.

In-memory layers are not here; the read paths check them first (invariant 6).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.key import Key, KeyRange


def select_layer(
    delta: PersistentLayer | None, image: PersistentLayer | None, end_lsn: int
) -> tuple[PersistentLayer, int] | None:
    if image is None:
        return None if delta is None else (delta, delta.desc.lsn_start)
    img_lsn = image.desc.image_lsn
    if delta is None:
        return image, img_lsn
    if image.desc.lsn_end >= delta.desc.lsn_end or img_lsn + 1 == end_lsn:
        return image, img_lsn
    return delta, max(delta.desc.lsn_start, img_lsn + 1)


class LayerMap:
    def __init__(self) -> None:
        self._layers: list[PersistentLayer] = []  # sorted by (lsn_end desc, lsn_start desc)

    def _sort(self) -> None:
        self._layers.sort(key=lambda layer: (-layer.desc.lsn_end, -layer.desc.lsn_start, layer.desc.key_range.start))

    def insert(self, layer: PersistentLayer) -> None:
        self._layers.append(layer)
        self._sort()

    def replace(self, remove: list[PersistentLayer], add: list[PersistentLayer]) -> None:
        """Swap layers atomically (no await in between, so readers never see a mix)."""
        gone = {id(x) for x in remove}
        self._layers = [x for x in self._layers if id(x) not in gone] + add
        self._sort()

    def __iter__(self) -> Iterator[PersistentLayer]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def l0_layers(self) -> list[PersistentLayer]:
        """L0 deltas, oldest first."""
        return sorted((x for x in self._layers if x.desc.is_l0), key=lambda x: x.desc.lsn_start)

    def _coverage(
        self, key: Key, end_lsn: int, candidates: list[PersistentLayer] | None = None
    ) -> tuple[PersistentLayer | None, PersistentLayer | None]:
        delta: PersistentLayer | None = None
        image: PersistentLayer | None = None
        for layer in self._layers if candidates is None else candidates:
            d = layer.desc
            if d.lsn_start >= end_lsn or not d.key_range.start <= key < d.key_range.end:
                continue
            if d.is_delta:
                if delta is None:
                    delta = layer
                    if image is not None:
                        break
            elif image is None:
                image = layer
                if delta is not None:
                    break
        return delta, image

    def search(self, key: Key, end_lsn: int) -> tuple[PersistentLayer, int] | None:
        """The layer to read for ``key`` below ``end_lsn`` and its LSN floor, or None."""
        delta, image = self._coverage(key, end_lsn)
        return select_layer(delta, image, end_lsn)

    def range_search(
        self, key_range: KeyRange, end_lsn: int
    ) -> tuple[list[tuple[PersistentLayer, int, KeyRange]], list[KeyRange]]:
        """``search`` for every key of a range at once: (found sub-ranges, not-found ones)."""
        cands = [
            x
            for x in self._layers
            if x.desc.lsn_start < end_lsn and x.desc.key_range.overlaps(key_range)
        ]
        points = {key_range.start, key_range.end}
        for x in cands:
            kr = x.desc.key_range
            if key_range.start < kr.start < key_range.end:
                points.add(kr.start)
            if key_range.start < kr.end < key_range.end:
                points.add(kr.end)
        bounds = sorted(points)
        found: list[tuple[PersistentLayer, int, KeyRange]] = []
        missing: list[KeyRange] = []
        for lo, hi in itertools.pairwise(bounds):
            delta, image = self._coverage(Key(lo), end_lsn, cands)
            hit = select_layer(delta, image, end_lsn)
            if hit is None:
                if missing and missing[-1].end == lo:
                    missing[-1] = KeyRange(missing[-1].start, Key(hi))
                else:
                    missing.append(KeyRange(Key(lo), Key(hi)))
                continue
            layer, floor = hit
            if found and found[-1][0] is layer and found[-1][1] == floor and found[-1][2].end == lo:
                found[-1] = (layer, floor, KeyRange(found[-1][2].start, Key(hi)))
            else:
                found.append((layer, floor, KeyRange(Key(lo), Key(hi))))
        return found, missing

    def count_deltas_above(self, key_range: KeyRange, lsn: int) -> int:
        """How many delta layers overlapping ``key_range`` end above ``lsn`` (image trigger)."""
        return sum(
            1
            for x in self._layers
            if x.desc.is_delta and x.desc.lsn_end > lsn and x.desc.key_range.overlaps(key_range)
        )

    def newest_image_covering(self, key_range: KeyRange, max_lsn: int) -> PersistentLayer | None:
        for x in self._layers:
            if not x.desc.is_delta and x.desc.image_lsn <= max_lsn and x.desc.key_range.covers(key_range):
                return x
        return None
