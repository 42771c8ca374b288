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

import bisect
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


_WHOLE = KeyRange.full()
_MAX_WHOLE_ANSWERS = 4096


class LayerMap:
    def __init__(self) -> None:
        # each sorted by (lsn_end desc, lsn_start desc): the first match of a scan is the
        # covering layer with the highest lsn_end
        self._layers: list[PersistentLayer] = []
        self._deltas: list[PersistentLayer] = []
        self._images: list[PersistentLayer] = []
        self._delta_neg_starts: list[int] = []
        self._image_neg_starts: list[int] = []
        self._bisectable = True
        # (lsn_start, key start, key end, layer) of each delta / image, in list order: what
        # ``search_span`` tests, without attribute chains
        self._delta_spans: list[tuple[int, bytes, bytes, PersistentLayer]] = []
        self._image_spans: list[tuple[int, bytes, bytes, PersistentLayer]] = []
        # search_span answers that hold for every key: end_lsn -> (delta, floor) when the first
        # delta below end_lsn covers the whole key space and no image starts below end_lsn
        # (an L0 stack: every walk asks the same questions). Emptied by every change.
        self._whole_answers: dict[int, tuple[PersistentLayer, int]] = {}

    def _sort(self) -> None:
        self._layers.sort(
            key=lambda x: (-x.desc.lsn_end, -x.desc.lsn_start, x.desc.key_range.start)
        )
        self._deltas = [x for x in self._layers if x.desc.is_delta]
        self._images = [x for x in self._layers if not x.desc.is_delta]
        # Delta LSN ranges are equal (one compaction's L1s) or disjoint, so sorted by lsn_end
        # descending they are sorted by lsn_start descending too: then the first candidate
        # below an LSN is found by bisection. Checked, not assumed.
        self._delta_neg_starts = [-x.desc.lsn_start for x in self._deltas]
        self._image_neg_starts = [-x.desc.lsn_start for x in self._images]
        self._bisectable = all(
            a <= b for a, b in itertools.pairwise(self._delta_neg_starts)
        ) and all(a <= b for a, b in itertools.pairwise(self._image_neg_starts))
        self._delta_spans = [
            (x.desc.lsn_start, x.desc.key_range.start, x.desc.key_range.end, x) for x in self._deltas
        ]
        self._whole_answers = {}
        self._image_spans = [
            (x.desc.lsn_start, x.desc.key_range.start, x.desc.key_range.end, x) for x in self._images
        ]

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
        return sorted((x for x in self._deltas if x.desc.is_l0), key=lambda x: x.desc.lsn_start)

    def _below(self, end_lsn: int) -> tuple[int, int]:
        """Indexes of the first delta / image that may start below ``end_lsn``."""
        if not self._bisectable:
            return 0, 0
        return (
            bisect.bisect_right(self._delta_neg_starts, -end_lsn),
            bisect.bisect_right(self._image_neg_starts, -end_lsn),
        )

    @staticmethod
    def _first_covering(
        layers: list[PersistentLayer], key: bytes, end_lsn: int, first: int = 0
    ) -> PersistentLayer | None:
        for i in range(first, len(layers)):
            layer = layers[i]
            d = layer.desc
            if d.lsn_start < end_lsn and d.key_range.start <= key < d.key_range.end:
                return layer
        return None

    def search(self, key: Key, end_lsn: int) -> tuple[PersistentLayer, int] | None:
        """The layer to read for ``key`` below ``end_lsn`` and its LSN floor, or None."""
        di, ii = self._below(end_lsn)
        delta = self._first_covering(self._deltas, key, end_lsn, di)
        image = self._first_covering(self._images, key, end_lsn, ii) if self._images else None
        return select_layer(delta, image, end_lsn)

    def search_span(self, first: Key, last: Key, end_lsn: int) -> tuple[PersistentLayer, int] | None:
        """``search``'s answer for every key of ``[first, last]`` when it is the same for all of
        them, else None (then ``range_search`` splits the range; None also when no layer holds
        any of the keys).

        The answer is shared when the first delta and the first image (in scan order) that
        overlap the span cover all of it: an earlier layer covering any key of the span would
        overlap it. For one key (``first == last``) it always is, and this is ``search``.
        """
        answer = self._whole_answers.get(end_lsn)
        if answer is not None:
            return answer
        di, ii = self._below(end_lsn)
        delta: PersistentLayer | None = None
        spans = self._delta_spans
        for i in range(di, len(spans)):
            lsn_start, start, end, layer = spans[i]
            if lsn_start < end_lsn and start <= last and first < end:
                if not (start <= first and last < end):
                    return None
                delta = layer
                break
        image: PersistentLayer | None = None
        spans = self._image_spans
        for i in range(ii, len(spans)):
            lsn_start, start, end, layer = spans[i]
            if lsn_start < end_lsn and start <= last and first < end:
                if not (start <= first and last < end):
                    return None
                image = layer
                break
        hit = select_layer(delta, image, end_lsn)
        if (
            hit is not None
            and image is None
            and ii == len(spans)
            and self._bisectable
            and self._deltas[di] is delta
            and delta.desc.key_range == _WHOLE
        ):
            if len(self._whole_answers) >= _MAX_WHOLE_ANSWERS:
                self._whole_answers.clear()  # request LSNs vary: keep it bounded
            self._whole_answers[end_lsn] = hit
        return hit

    def read_candidates(self, first: Key, last: Key, end_lsn: int, limit: int) -> list[PersistentLayer]:
        """Up to ``limit`` layers a walk over ``[first, last]`` below ``end_lsn`` may visit,
        newest first: all that overlap the span, down to the first image layer covering all
        of it (the walk ends there). For prefetching only: it may name a layer the walk
        then skips."""
        out: list[PersistentLayer] = []
        for layer in self._layers:
            d = layer.desc
            kr = d.key_range
            if d.lsn_start < end_lsn and kr.start <= last and first < kr.end:
                out.append(layer)
                if len(out) >= limit or (not d.is_delta and kr.start <= first and last < kr.end):
                    break
        return out

    def range_search(
        self, key_range: KeyRange, end_lsn: int
    ) -> tuple[list[tuple[PersistentLayer, int, KeyRange]], list[KeyRange]]:
        """``search`` for every key of a range at once: (found sub-ranges, not-found ones)."""
        lo_key, hi_key = key_range.start, key_range.end
        di, ii = self._below(end_lsn)
        if not self._images or not any(
            x.desc.lsn_start < end_lsn and x.desc.key_range.start < hi_key and lo_key < x.desc.key_range.end
            for x in self._images[ii:]
        ):
            # No image to clamp to: if the newest overlapping delta covers the whole range, it
            # is the answer everywhere (the common L0-stack case, no lists built).
            for i in range(di, len(self._deltas)):
                x = self._deltas[i]
                d = x.desc
                if d.lsn_start < end_lsn and d.key_range.start < hi_key and lo_key < d.key_range.end:
                    if d.key_range.start <= lo_key and hi_key <= d.key_range.end:
                        return [(x, d.lsn_start, key_range)], []
                    break
        deltas = [
            x
            for x in self._deltas
            if x.desc.lsn_start < end_lsn and x.desc.key_range.start < hi_key and lo_key < x.desc.key_range.end
        ]
        images = [
            x
            for x in self._images
            if x.desc.lsn_start < end_lsn and x.desc.key_range.start < hi_key and lo_key < x.desc.key_range.end
        ]
        points = {lo_key, hi_key}
        for x in (*deltas, *images):
            kr = x.desc.key_range
            if lo_key < kr.start < hi_key:
                points.add(kr.start)
            if lo_key < kr.end < hi_key:
                points.add(kr.end)
        bounds = sorted(points)
        found: list[tuple[PersistentLayer, int, KeyRange]] = []
        missing: list[KeyRange] = []
        for lo, hi in itertools.pairwise(bounds):
            hit = select_layer(
                self._first_covering(deltas, lo, end_lsn),
                self._first_covering(images, lo, end_lsn),
                end_lsn,
            )
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
