"""Layer files: round trips, corruption and truncation errors, vectored coalescing, layer map."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as hst

from pageserver.storage.delta_layer import (
    PersistentLayer,
    ReadContext,
    read_and_resolve,
    write_delta_layer,
)
from pageserver.storage.image_layer import ImageLayer, write_image_layer
from pageserver.storage.io_engine import BlockingIoEngine
from pageserver.storage.key import Key, KeyRange, key_next, rel_block_key
from pageserver.storage.layer_file import ENTRIES_PER_BLOCK, IndexBlockCache, LayerCorruptionError
from pageserver.storage.layer_map import LayerMap
from pageserver.storage.page_cache import PageCache
from pageserver.storage.reconstruct import KeyState
from pageserver.storage.value import Image, TestRecord, Value, encode_value
from protocol.lsn import Lsn

N_KEYS = 500  # more than one index block


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


async def _entries(items: Sequence[tuple[Key, int, Value]]) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
    for key, lsn, value in items:
        yield key, Lsn(lsn), encode_value(value), value.will_init


def _deferring(states: dict[Key, KeyState]) -> dict[Key, KeyState]:
    for st in states.values():
        st.pending = []
    return states


def _delta_items() -> list[tuple[Key, int, Value]]:
    items: list[tuple[Key, int, Value]] = []
    for i in range(N_KEYS):
        items.append((k(i), 100, Image(f"base{i}".encode())))
        items.extend((k(i), lsn, TestRecord.wal_append(f",{lsn}")) for lsn in (110, 120))
    return items


async def _write_delta(tmp_path: Path) -> Path:
    path = await write_delta_layer(
        BlockingIoEngine(), tmp_path, KeyRange(k(0), k(N_KEYS)), Lsn(100), Lsn(130), _entries(_delta_items())
    )
    assert path is not None
    return path


async def test_delta_layer_round_trip_both_paths(tmp_path: Path) -> None:
    engine = BlockingIoEngine()
    path = await _write_delta(tmp_path)
    assert N_KEYS * 3 > ENTRIES_PER_BLOCK
    layer = await PersistentLayer.open(engine, path, IndexBlockCache(16))
    assert layer.desc.is_delta and not isinstance(layer, ImageLayer)
    for i in (0, 77, N_KEYS - 1):
        st = KeyState()
        await layer.get_value_legacy(k(i), 0, 125, st)
        assert st.complete and st.img == (100, f"base{i}".encode())
        assert [lsn for lsn, _ in st.records] == [120, 110]
        st2 = KeyState()
        await layer.get_value_legacy(k(i), 0, 115, st2)
        assert [lsn for lsn, _ in st2.records] == [110]
    states = _deferring({k(i): KeyState() for i in range(N_KEYS)})
    ctx = ReadContext(max_vectored_read_bytes=128 * 1024)
    engine.stats.reset()
    await layer.get_values_vectored(sorted(states), 0, 130, states, ctx)
    await read_and_resolve(ctx, states.values())
    for i, st in enumerate(states.values()):
        assert st.complete and st.img == (100, f"base{i}".encode())
        assert len(st.records) == 2
    # all blobs of the layer are adjacent: one preadv, in one engine call
    assert engine.stats.preadvs == ctx.vectored_reads == 1
    assert engine.stats.run_syncs == 1
    await layer.aclose()


async def test_vectored_read_splits_at_max_bytes_and_gaps(tmp_path: Path) -> None:
    engine = BlockingIoEngine()
    layer = await PersistentLayer.open(engine, await _write_delta(tmp_path), IndexBlockCache(16))
    keys = [k(i) for i in range(40)]
    states = _deferring({key: KeyState() for key in keys})
    ctx = ReadContext(max_vectored_read_bytes=64)
    await layer.get_values_vectored(keys, 0, 130, states, ctx)
    await read_and_resolve(ctx, states.values())
    assert ctx.vectored_reads > 1
    assert all(st.complete for st in states.values())
    # every other key: blobs are not adjacent, so one read per key
    sparse = [k(i) for i in range(0, 40, 2)]
    states = _deferring({key: KeyState() for key in sparse})
    ctx = ReadContext()
    await layer.get_values_vectored(sparse, 0, 130, states, ctx)
    await read_and_resolve(ctx, states.values())
    assert ctx.vectored_reads == len(sparse)
    await layer.aclose()


async def test_image_layer_absent_key_is_missing(tmp_path: Path) -> None:
    async def images() -> AsyncIterator[tuple[Key, bytes]]:
        for i in range(0, 20, 2):
            yield k(i), b"page%d" % i

    engine = BlockingIoEngine()
    path = await write_image_layer(engine, tmp_path, KeyRange(k(0), k(20)), Lsn(50), images())
    assert path is not None
    layer = await PersistentLayer.open(engine, path, IndexBlockCache(4))
    assert isinstance(layer, ImageLayer)
    states = _deferring({k(i): KeyState() for i in range(4)})
    ctx = ReadContext()
    await layer.get_values_vectored(sorted(states), 50, 60, states, ctx)
    await read_and_resolve(ctx, states.values())
    assert states[k(0)].img == (50, b"page0") and not states[k(0)].missing
    assert states[k(1)].missing and states[k(1)].complete
    legacy = KeyState()
    await layer.get_value_legacy(k(3), 50, 60, legacy)
    assert legacy.missing
    await layer.aclose()


@pytest.mark.parametrize("where", ["summary", "data", "index", "fences", "truncate", "magic"])
async def test_corrupt_or_truncated_file_names_the_file(tmp_path: Path, where: str) -> None:
    engine = BlockingIoEngine()
    path = await _write_delta(tmp_path)
    layer = await PersistentLayer.open(engine, path, IndexBlockCache(16))
    s = layer.reader.summary
    await layer.aclose()
    raw = bytearray(path.read_bytes())
    offsets = {
        "summary": 30,
        "data": 4096 + 3,
        "index": s.index_start + 100,
        "fences": s.fence_start + 5,
        "magic": 0,
    }
    if where == "truncate":
        raw = raw[: len(raw) - 7]
    else:
        raw[offsets[where]] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(LayerCorruptionError) as info:
        layer = await PersistentLayer.open(engine, path, IndexBlockCache(16))
        try:
            states = _deferring({k(i): KeyState() for i in range(N_KEYS)})
            ctx = ReadContext()
            await layer.get_values_vectored(sorted(states), 0, 130, states, ctx)
            await read_and_resolve(ctx, states.values())
            for i in range(N_KEYS):
                await layer.get_value_legacy(k(i), 0, 130, KeyState())
        finally:
            await layer.aclose()
    assert str(path) in str(info.value)
    assert info.value.sqlstate == "XX001"


async def test_layer_map_select_layer_rules(tmp_path: Path) -> None:
    engine = BlockingIoEngine()
    cache = IndexBlockCache(8)

    async def one(key_range: KeyRange, lo: int, hi: int) -> PersistentLayer:
        path = await write_delta_layer(
            engine, tmp_path, key_range, Lsn(lo), Lsn(hi), _entries([(key_range.start, lo, Image(b"x"))])
        )
        assert path is not None
        return await PersistentLayer.open(engine, path, cache)

    async def image(key_range: KeyRange, lsn: int) -> PersistentLayer:
        async def imgs() -> AsyncIterator[tuple[Key, bytes]]:
            yield key_range.start, b"i"

        path = await write_image_layer(engine, tmp_path, key_range, Lsn(lsn), imgs())
        assert path is not None
        return await PersistentLayer.open(engine, path, cache)

    full = KeyRange.full()
    d1 = await one(full, 10, 20)
    d2 = await one(full, 20, 30)
    img = await image(KeyRange(k(0), k(10)), 25)
    lm = LayerMap()
    for x in (d1, d2, img):
        lm.insert(x)
    # delta newer than the image: read the delta, clamped to just above the image
    assert lm.search(k(1), 30) == (d2, 26)
    # exact image match
    assert lm.search(k(1), 26) == (img, 25)
    # below the image
    assert lm.search(k(1), 25) == (d2, 20)
    # key outside the image range
    assert lm.search(k(50), 30) == (d2, 20)
    assert lm.search(k(1), 10) is None
    found, missing = lm.range_search(KeyRange(k(5), k(15)), 30)
    assert [(layer, floor, r) for layer, floor, r in found] == [
        (d2, 26, KeyRange(k(5), k(10))),
        (d2, 20, KeyRange(k(10), k(15))),
    ]
    assert missing == []
    assert lm.range_search(KeyRange(k(5), key_next(k(5))), 5) == ([], [KeyRange(k(5), key_next(k(5)))])
    for x in (d1, d2, img):
        await x.aclose()


def test_page_cache_bounded_newest_at_or_below() -> None:
    cache = PageCache(capacity_bytes=3 * (100 + 64))
    tl = b"t" * 16
    for lsn in (10, 20, 30):
        cache.memorize(tl, k(1), lsn, bytes(100))
    assert cache.lookup(tl, k(1), 25) == (20, bytes(100))
    assert cache.lookup(tl, k(1), 5) is None
    assert cache.lookup(tl, k(2), 50) is None
    cache.memorize(tl, k(2), 10, bytes(100))  # evicts the least recently used (lsn 10)
    assert len(cache) == 3
    assert cache.lookup(tl, k(1), 15) is None
    assert cache.size_bytes <= cache.capacity_bytes
    assert cache.hits == 1 and cache.misses == 3


def test_layer_file_names_round_trip() -> None:
    from pageserver.storage.layer_file import LayerDesc

    d = LayerDesc(KeyRange.full(), Lsn(0x9E75829), Lsn(0xA21E919), True)
    assert d.file_name() == (
        "000000000000000000000000000000000000-FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF"
        "__0000000009E75829-000000000A21E919"
    )
    assert LayerDesc.parse_file_name(d.file_name()) == d
    i = LayerDesc(KeyRange(k(0), k(9)), Lsn(77), Lsn(78), False)
    assert LayerDesc.parse_file_name(i.file_name()) == i
    assert LayerDesc.parse_file_name("ephemeral-3") is None
    assert LayerDesc.parse_file_name(d.file_name() + ".___temp") is None
    assert os.sep not in d.file_name()


_FUZZ_KEYS = 300


def _fuzz_layer_bytes() -> tuple[str, bytes]:
    """(file name, contents) of a small delta layer, built once."""
    cached = _fuzz_cache.get("layer")
    if cached is None:
        directory = Path(tempfile.mkdtemp(prefix="pagestore-fuzz-"))
        items = [
            (k(i), lsn, v)
            for i in range(_FUZZ_KEYS)
            for lsn, v in ((100, Image(b"base%d" % i)), (110, TestRecord.wal_append(f",{i}")))
        ]

        async def build() -> Path | None:
            return await write_delta_layer(
                BlockingIoEngine(), directory, KeyRange(k(0), k(_FUZZ_KEYS)), Lsn(100), Lsn(120),
                _entries(items),
            )

        path = trio.run(build)
        assert path is not None
        cached = (path.name, path.read_bytes())
        _fuzz_cache["layer"] = cached
        shutil.rmtree(directory)
    return cached


_fuzz_cache: dict[str, tuple[str, bytes]] = {}


@settings(max_examples=60, deadline=None)
@given(where=hst.floats(0, 1, exclude_max=True), xor=hst.integers(1, 255))
def test_any_flipped_byte_gives_right_values_or_a_corruption_error(where: float, xor: int) -> None:
    name, contents = _fuzz_layer_bytes()
    raw = bytearray(contents)
    raw[int(where * len(raw))] ^= xor
    directory = Path(tempfile.mkdtemp(prefix="pagestore-fuzz-"))
    path = directory / name
    path.write_bytes(bytes(raw))

    async def read_all() -> None:
        engine = BlockingIoEngine()
        layer = await PersistentLayer.open(engine, path, IndexBlockCache(16))
        try:
            states = _deferring({k(i): KeyState() for i in range(_FUZZ_KEYS)})
            ctx = ReadContext()
            await layer.get_values_vectored(sorted(states), 0, 120, states, ctx)
            await read_and_resolve(ctx, states.values())
            for i, state in enumerate(states.values()):
                assert state.img == (100, b"base%d" % i)
                assert state.records == [(110, TestRecord.wal_append(f",{i}"))]
                legacy = KeyState()
                await layer.get_value_legacy(k(i), 0, 120, legacy)
                assert legacy.img == state.img and legacy.records == state.records
        finally:
            await layer.aclose()

    try:
        trio.run(read_all)
    except LayerCorruptionError as exc:
        assert str(path) in str(exc)
    finally:
        shutil.rmtree(directory)
