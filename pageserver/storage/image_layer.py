"""Image layers: one value per existing key of a key range, as of one LSN.

Same file format as delta layers (``layer_file``), magic ``PSIM``, every entry at the image LSN,
``lsn_range = [L, L+1)``. An image layer is complete for its key range: a key routed to it but
absent from it does not exist at that LSN, on both read paths (``MissingKeyError``), unless the
materialized page cache already covers the key at or above L.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from pageserver.storage.delta_layer import PersistentLayer, ReadContext
from pageserver.storage.io_engine import IoEngine
from pageserver.storage.key import Key, KeyRange
from pageserver.storage.layer_file import LayerDesc, LayerFileWriter, WriteOptions, write_layer_file
from pageserver.storage.reconstruct import KeyState
from pageserver.storage.value import Image, encode_value
from protocol.lsn import Lsn


class ImageLayer(PersistentLayer):
    def _absent(self, state: KeyState, floor: int) -> None:
        state.floor_reached(self.desc.image_lsn)
        if not state.complete and state.cached_lsn >= self.desc.image_lsn:
            state.complete = True
        if not state.complete:
            state.missing = True
            state.complete = True

    completes_keys = True

    def _remaining(
        self, keys: Sequence[Key], floor: int, states: dict[Key, KeyState], ctx: ReadContext
    ) -> Sequence[Key]:
        # complete for its key range: every key routed here ends here
        for key in keys:
            st = states[key]
            if not st.complete:
                self._absent(st, floor)
        return []


async def write_image_layer(
    engine: IoEngine,
    directory: Path,
    key_range: KeyRange,
    lsn: Lsn,
    images: AsyncIterator[tuple[Key, bytes]],
    *,
    opts: WriteOptions | None = None,
) -> Path | None:
    """Write an image layer from (key, page) in key order; None if there were none."""
    async def fill(writer: LayerFileWriter) -> None:
        async for key, page in images:
            await writer.put(key, lsn, encode_value(Image(page)), True)

    return await write_layer_file(engine, directory, LayerDesc(key_range, lsn, Lsn(lsn + 1), False), opts, fill)
