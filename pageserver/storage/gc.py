"""GC: which historic layers may be deleted (storage.md §2.9).

A layer may go only if all of these hold: it ends at or below the GC cutoff
(``min(horizon_cutoff, pitr_cutoff)``); image layers at LSNs in ``[layer end - 1, cutoff]``
(strictly newer than an image victim) cover its whole key range (so every read at or above the cutoff stops before reaching it); and
for every child branch point ``retain_lsn >= layer start``, such image layers at or below
``retain_lsn`` cover it too (so reads of the child below its branch point never
need it). Whole files only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.key import KeySpace


def _covered_by_images(layer: PersistentLayer, images: Sequence[PersistentLayer], up_to: int) -> bool:
    d = layer.desc
    # A delta holds LSNs up to lsn_end - 1, so an image at that LSN already includes all of it.
    # An image is only replaced by a strictly newer one (two images at one LSN must not
    # justify removing each other).
    lowest = d.lsn_end - 1 if d.is_delta else d.lsn_end
    cover = KeySpace.from_ranges(
        img.desc.key_range
        for img in images
        if lowest <= img.desc.image_lsn <= up_to and img.desc.key_range.overlaps(d.key_range)
    )
    return KeySpace.single(d.key_range).subtract(cover).is_empty()


def select_gc_victims(
    layers: Sequence[PersistentLayer], cutoff: int, retain_lsns: Sequence[int]
) -> list[PersistentLayer]:
    images = [x for x in layers if not x.desc.is_delta]
    victims: list[PersistentLayer] = []
    for layer in layers:
        d = layer.desc
        if d.lsn_end > cutoff:
            continue
        if not _covered_by_images(layer, images, cutoff):
            continue
        if any(
            r >= d.lsn_start and not _covered_by_images(layer, images, r) for r in retain_lsns
        ):
            continue
        victims.append(layer)
    return victims
