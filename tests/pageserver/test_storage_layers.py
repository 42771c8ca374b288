"""Layer files: round trips, corruption and truncation errors, vectored coalescing, layer map."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import tracemalloc
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import crc32c
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
from pageserver.storage.layer_file import (
    DATA_START,
    DELTA_MAGIC,
    ENTRIES_PER_BLOCK,
    ENTRY,
    IMAGE_MAGIC,
    INDEX_BLOCK_SIZE,
    IndexBlockCache,
    LayerCorruptionError,
    LayerDesc,
    LayerFileWriter,
    Summary,
    WriteOptions,
    prefix_of,
)
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


# -- the writer spills its index: bounded memory, unchanged bytes --------------------------


def _reference_layer_bytes(desc: LayerDesc, entries: Sequence[tuple[Key, int, bytes, bool]]) -> bytes:
    """The whole file as the writer that kept its index in memory produced it (the format of
    docs/storage-format.md, built independently of LayerFileWriter)."""
    blobs = bytearray()
    blocks: list[bytearray] = []
    fences: list[bytes] = []
    for key, lsn, blob, will_init in entries:
        prefix = prefix_of(key, lsn)
        if not blocks or len(blocks[-1]) == 8 + ENTRIES_PER_BLOCK * ENTRY.size:
            blocks.append(bytearray(8))
            fences.append(prefix)
        pos = (DATA_START + len(blobs)) << 1 | will_init
        blocks[-1] += ENTRY.pack(prefix, pos, len(blob), crc32c.crc32c(blob))
        blobs += blob
    index = bytearray()
    for block in blocks:
        n = (len(block) - 8) // ENTRY.size
        block += bytes(INDEX_BLOCK_SIZE - len(block))
        struct.pack_into(">HH", block, 4, n, 0)
        struct.pack_into(">I", block, 0, crc32c.crc32c(bytes(block[4:])))
        index += block
    data_end = DATA_START + len(blobs)
    fence_bytes = b"".join(fences)
    summary = Summary(
        magic=DELTA_MAGIC if desc.is_delta else IMAGE_MAGIC,
        key_range=desc.key_range,
        lsn_start=desc.lsn_start,
        lsn_end=desc.lsn_end,
        data_end=data_end,
        index_start=data_end,
        n_index_blocks=len(blocks),
        n_entries=len(entries),
        fence_start=data_end + len(index),
        file_size=data_end + len(index) + len(fence_bytes),
        fences_crc=crc32c.crc32c(fence_bytes),
    ).encode()
    return summary + bytes(DATA_START - len(summary)) + bytes(blobs) + bytes(index) + fence_bytes


async def _write_all(
    directory: Path, desc: LayerDesc, entries: Sequence[tuple[Key, int, bytes, bool]], opts: WriteOptions
) -> Path:
    writer = await LayerFileWriter.create(BlockingIoEngine(), directory, desc, opts)
    for key, lsn, blob, will_init in entries:
        await writer.put(key, lsn, blob, will_init)
    return await writer.finish()


@pytest.mark.parametrize(
    "n", [1, ENTRIES_PER_BLOCK - 1, ENTRIES_PER_BLOCK, ENTRIES_PER_BLOCK + 1, 5 * ENTRIES_PER_BLOCK, 7000]
)
@pytest.mark.parametrize("buffer_size", [4096, 64 * 1024])
async def test_writer_output_is_byte_identical_to_the_in_memory_index_writer(
    tmp_path: Path, n: int, buffer_size: int
) -> None:
    entries = [
        (k(i // 3), 100 + i % 3, encode_value(Image(b"x" * (i % 37))), i % 3 == 0) for i in range(n)
    ]
    desc = LayerDesc(KeyRange(k(0), k(n)), Lsn(100), Lsn(103), True)
    path = await _write_all(tmp_path, desc, entries, WriteOptions(buffer_size=buffer_size))
    assert path.read_bytes() == _reference_layer_bytes(desc, entries)
    # the scratch index file is gone; only the layer is left
    assert [p.name for p in tmp_path.iterdir()] == [desc.file_name()]
    layer = await PersistentLayer.open(BlockingIoEngine(), path, IndexBlockCache(4))
    try:
        assert layer.file_size == len(path.read_bytes())
    finally:
        await layer.aclose()


async def test_image_writer_output_is_byte_identical(tmp_path: Path) -> None:
    pages = [(k(i), bytes([i % 251]) * 8192) for i in range(300)]

    async def images() -> AsyncIterator[tuple[Key, bytes]]:
        for key, page in pages:
            yield key, page

    path = await write_image_layer(BlockingIoEngine(), tmp_path, KeyRange(k(0), k(300)), Lsn(200), images())
    assert path is not None
    desc = LayerDesc(KeyRange(k(0), k(300)), Lsn(200), Lsn(201), False)
    want = _reference_layer_bytes(desc, [(key, 200, encode_value(Image(p)), True) for key, p in pages])
    assert path.read_bytes() == want


async def test_failed_write_removes_the_layer_and_index_scratch_files(tmp_path: Path) -> None:
    desc = LayerDesc(KeyRange(k(0), k(10_000)), Lsn(100), Lsn(101), True)

    async def entries() -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
        for i in range(3 * ENTRIES_PER_BLOCK):
            yield k(i), Lsn(100), b"v%d" % i, True
        raise OSError("source failed")

    with pytest.raises(OSError, match="source failed"):
        await write_delta_layer(BlockingIoEngine(), tmp_path, desc.key_range, Lsn(100), Lsn(101), entries())
    assert list(tmp_path.iterdir()) == []
    # a scratch file left by a crash is no layer (Tenant.load deletes every unlisted file)
    assert LayerDesc.parse_file_name(desc.file_name() + ".___temp.index") is None


async def test_writer_index_memory_is_bounded(tmp_path: Path) -> None:
    """The old writer held 42 bytes per entry until finish (12.6 MB here); the spilling one
    holds one block, the fences and its buffers."""
    n = 300_000
    desc = LayerDesc(KeyRange.full(), Lsn(100), Lsn(200), True)
    blob = encode_value(TestRecord.wal_append("x"))
    writer = await LayerFileWriter.create(BlockingIoEngine(), tmp_path, desc, WriteOptions())
    tracemalloc.start()
    try:
        for i in range(n):
            await writer.put(k(i), 150, blob, False)
        path = await writer.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < n * 6, f"writer peak {peak} bytes for {n} entries"
    size = path.stat().st_size
    assert size == DATA_START + n * len(blob) + -(-n // ENTRIES_PER_BLOCK) * (INDEX_BLOCK_SIZE + 26)
    layer = await PersistentLayer.open(BlockingIoEngine(), path, IndexBlockCache(4))
    try:
        states = _deferring({k(i): KeyState() for i in (0, n // 2, n - 1)})
        ctx = ReadContext()
        await layer.get_values_vectored(sorted(states), 0, 200, states, ctx)
        await read_and_resolve(ctx, states.values())
        for state in states.values():
            assert state.records == [(150, TestRecord.wal_append("x"))]
    finally:
        await layer.aclose()


_PUT_STEPS = hst.lists(
    # (key, LSN step (LSNs never fall: the caller's contract; 0 repeats a key's LSN, which
    # replaces its value), blob size, will_init)
    hst.tuples(hst.integers(0, 3), hst.integers(0, 3), hst.integers(0, 300), hst.booleans()),
    max_size=150,
)


@settings(max_examples=200, deadline=None)
@given(
    steps=_PUT_STEPS,
    buffer_size=hst.sampled_from([512, 2048, 1 << 16]),
    max_size=hst.sampled_from([1 << 62, 3000, 20_000]),
)
def test_try_put_mixed_of_values_stores_what_put_stores(
    steps: list[tuple[int, int, int, bool]], buffer_size: int, max_size: int
) -> None:
    """``InMemoryLayer.try_put_mixed`` of single values driven like the WAL ingest (the item it does not take goes
    through ``put``) leaves the same index, file bytes and ``max_lsn`` as ``put`` per item:
    runs of one key, a key coming back, a repeated LSN (replaced), a full buffer and the
    ``max_size`` limit included."""
    from pageserver.storage.ephemeral_file import EphemeralFile
    from pageserver.storage.inmemory_layer import InMemoryLayer

    items: list[tuple[Key, Lsn, bytes, bool]] = []
    lsn = 100
    for n, (key, step, size, will_init) in enumerate(steps):
        lsn += step
        items.append((k(key), Lsn(lsn), bytes([n % 251]) * size, will_init))

    async def run(fast: bool, directory: str) -> tuple[object, ...]:
        engine = BlockingIoEngine()
        file = await EphemeralFile.create(
            engine, directory, write_buffer_size=buffer_size, double_buffering=False
        )
        layer = InMemoryLayer(file, Lsn(100))
        i = layer.try_put_mixed(items, 0, 0, max_size)[0] if fast else 0
        while i < len(items):
            await layer.put(*items[i])
            i = layer.try_put_mixed(items, i + 1, 0, max_size)[0] if fast else i + 1
        index = {key: list(entries) for key, entries in layer.index.items()}
        await layer.freeze(Lsn(1 << 40))
        data = await file.read_all()
        await layer.aclose()
        return index, data, layer.max_lsn

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        assert trio.run(run, True, a) == trio.run(run, False, b)
