"""``index_part.json``: the durable list of a timeline's layers and its ``disk_consistent_lsn``.

It is the single source of truth at load: exactly the listed layers are opened (their sizes
checked), anything else in the timeline directory (temp files of an interrupted flush or
compaction, ephemeral files, layers a compaction or GC replaced) is deleted. It is written to a
temp file, fsynced, renamed over the old one and the directory fsynced (``durable_rename``), so
a crash leaves either the old or the new list, never a torn one. A layer file is made durable
before any index_part that lists it is written, and deleted only after one that no longer lists
it was written.

The remote index (the same document, uploaded as ``index_part.json-<generation>``) also says
per layer how its object is stored: the generation that uploaded it and, for a compressed
object, ``"compression": "zstd"`` or ``"lz4"`` and ``compressed_size``
(``pageserver.remote_compression``). A build reads only the codecs it knows: an index naming
one it does not (``"lz4"`` for builds before it) is refused as invalid (XX001), never read as
an uncompressed layer, so roll a node back only to a build that knows every codec its indexes
name.
A layer without them is stored as it is: indexes written before compression (version 1) read
the same. ``version`` 2 is written only when the index names a compressed object, 1 otherwise
(every local index, and every remote one with ``compression = "none"``), so a node can still be
rolled back to a build that reads only version 1 once its compressed layers are gone; 1 and 2
are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import attrs

from pageserver.storage.io_engine import IoEngine, durable_rename
from protocol.errors import RemoteProtocolError
from protocol.lsn import INVALID_LSN, Lsn, format_lsn, parse_lsn
from remote_storage.config import COMPRESSIONS, Compression

INDEX_PART = "index_part.json"
INDEX_PART_VERSION = 2  # when a layer's object is compressed; 1 without
READ_VERSIONS: Final = frozenset((1, 2))


@attrs.frozen
class StoredLayer:
    """How one layer's remote object is stored: its compression and its size in bytes."""

    compression: Compression
    size: int


@attrs.frozen
class IndexPart:
    layers: dict[str, int]  # file name -> size in bytes
    disk_consistent_lsn: Lsn
    latest_gc_cutoff_lsn: Lsn = INVALID_LSN
    ancestor_timeline_id: str | None = None
    ancestor_lsn: Lsn = INVALID_LSN
    # The remote index's layer name -> generation of the attachment that uploaded it (the
    # object's key suffix, ``pageserver.remote_layout``); empty in the local index_part.
    generations: dict[str, int] = attrs.field(factory=dict)
    # The remote index's layer name -> its object's form, for objects not stored as they are
    # (absent: the object is the file, ``file_size`` bytes); empty in the local index_part.
    stored: dict[str, StoredLayer] = attrs.field(factory=dict)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "version": INDEX_PART_VERSION if self.stored else 1,
            "disk_consistent_lsn": format_lsn(self.disk_consistent_lsn),
            "latest_gc_cutoff_lsn": format_lsn(self.latest_gc_cutoff_lsn),
            "ancestor_timeline_id": self.ancestor_timeline_id,
            "ancestor_lsn": format_lsn(self.ancestor_lsn),
            "layers": {name: self._layer_meta(name, size) for name, size in sorted(self.layers.items())},
        }
        return json.dumps(doc, indent=1).encode()

    def _layer_meta(self, name: str, size: int) -> dict[str, int | str]:
        meta: dict[str, int | str] = {"file_size": size}
        gen = self.generations.get(name)
        if gen is not None:
            meta["generation"] = gen
        stored = self.stored.get(name)
        if stored is not None and stored.compression != "none":
            meta["compression"] = stored.compression
            meta["compressed_size"] = stored.size
        return meta

    def stored_layer(self, name: str) -> StoredLayer:
        """How layer ``name``'s remote object is stored (default: as it is)."""
        got = self.stored.get(name)
        return got if got is not None else StoredLayer("none", self.layers[name])

    @classmethod
    def from_json(cls, path: Path, raw: bytes) -> IndexPart:
        try:
            doc = json.loads(raw)
            if doc["version"] not in READ_VERSIONS:
                raise ValueError(f"unsupported version {doc['version']}")
            layers = {str(name): _size(meta["file_size"]) for name, meta in doc["layers"].items()}
            generations = {
                str(name): int(meta["generation"]) for name, meta in doc["layers"].items() if "generation" in meta
            }
            if any(not 0 < g < 1 << 32 for g in generations.values()):
                raise ValueError("a layer generation is out of range")
            stored = {str(name): s for name, meta in doc["layers"].items() if (s := _stored(name, meta)) is not None}
            anc = doc["ancestor_timeline_id"]
            return cls(
                layers=layers,
                disk_consistent_lsn=parse_lsn(doc["disk_consistent_lsn"]),
                latest_gc_cutoff_lsn=parse_lsn(doc["latest_gc_cutoff_lsn"]),
                ancestor_timeline_id=None if anc is None else str(anc),
                ancestor_lsn=parse_lsn(doc["ancestor_lsn"]),
                generations=generations,
                stored=stored,
            )
        except (ValueError, KeyError, TypeError, AttributeError, RemoteProtocolError) as exc:
            raise RemoteProtocolError(f"{path}: invalid index_part: {exc}", sqlstate="XX001") from exc


def _size(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"a size must be a non-negative integer, got {value!r}")
    return value


def _stored(name: str, meta: dict[str, Any]) -> StoredLayer | None:
    compression = meta.get("compression", "none")
    if compression == "none":
        if "compressed_size" in meta:
            raise ValueError(f"layer {name}: compressed_size without a compression")
        return None
    if compression not in COMPRESSIONS:
        raise ValueError(f"layer {name}: unknown compression {compression!r}")
    size = _size(meta["compressed_size"])
    if size == 0:
        raise ValueError(f"layer {name}: compressed_size 0")
    return StoredLayer(compression, size)


async def write_index_part(engine: IoEngine, directory: Path, part: IndexPart) -> None:
    tmp = directory / (INDEX_PART + ".___temp")
    # Every flush writes an index_part: the unlink goes the engine's way like the writes.
    await engine.unlink(tmp)
    file = await engine.open_file(tmp, "x")
    try:
        await file.write_at(0, part.to_json())
    finally:
        await file.aclose()
    await durable_rename(engine, tmp, directory / INDEX_PART)


async def read_index_part(engine: IoEngine, directory: Path) -> IndexPart:
    path = directory / INDEX_PART
    file = await engine.open_file(path, "r")
    try:
        raw = await file.read_at(0, await file.size())
    finally:
        await file.aclose()
    return IndexPart.from_json(path, raw)
