"""The vectored read path's fast paths agree with the general ones and with the legacy oracle.

- ``PersistentLayer.plan_reads`` (one backward pass over the index) and ``plan_key`` (the
  single-key path) against ``get_value_legacy`` on random layers, LSN windows and cached pages;
- ``execute_reads``' inlined decoding (images as bare bytes) against ``decode_value``, including
  hostile blobs;
- ``LayerMap.search_span`` against ``search`` key by key, and ``read_candidates`` (the cold
  walk's prefetch list) naming every layer a walk visits;
- ``apply_test_records``' append-only fast path against a plain model of Test records;
- the cold-read machinery (``RWF_NOWAIT`` probe + ``POSIX_FADV_WILLNEED``, index prefetch) reads
  the same bytes as a plain read, and the single-key walk (``_walk_one``) serves ``get``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import cast

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as hst

from pageserver.storage import _blobs_py, delta_layer, read_path
from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import (
    PersistentLayer,
    ReadContext,
    read_and_resolve,
    write_delta_layer,
)
from pageserver.storage.image_layer import write_image_layer
from pageserver.storage.io_engine import BlockingIoEngine
from pageserver.storage.key import Key, KeyRange, rel_block_key
from pageserver.storage.layer_file import ENTRIES_PER_BLOCK, IndexBlockCache, LayerDesc
from pageserver.storage.layer_map import LayerMap
from pageserver.storage.reconstruct import KeyState, PageReconstructError, apply_test_records
from pageserver.storage.value import (
    Image,
    PostgresRecord,
    TestRecord,
    Value,
    WalRecordValue,
    decode_value,
    encode_value,
)
from pageserver.tenant import Tenant
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


# -- layer level: plan_reads / plan_key vs get_value_legacy ---------------------------------------

_values = hst.one_of(
    hst.builds(lambda s: Image(s.encode()), hst.text("abc", max_size=6)),
    hst.builds(TestRecord.wal_append, hst.text("xyz", max_size=4)),
    hst.builds(TestRecord.wal_init, hst.text("xyz", max_size=4)),
    hst.builds(PostgresRecord, hst.booleans(), hst.binary(max_size=8)),
)


@hst.composite
def _layer_items(draw: hst.DrawFn) -> list[tuple[Key, int, Value]]:
    """Entries of one delta layer over LSNs [100, 140): up to 8 keys with up to 6 versions,
    and sometimes one key with more versions than an index block holds."""
    items: list[tuple[Key, int, Value]] = []
    long_key = draw(hst.one_of(hst.none(), hst.integers(0, 7)))
    for i in range(8):
        if i == long_key:
            lsns = list(range(100, 100 + ENTRIES_PER_BLOCK + 40, 1))
            versions: list[Value] = [Image(b"base")]
            versions.extend(TestRecord.wal_append(f",{n}") for n in range(len(lsns) - 1))
            items.extend((k(i), lsn, v) for lsn, v in zip(lsns, versions, strict=True))
            continue
        lsns = sorted(draw(hst.sets(hst.integers(100, 139), max_size=6)))
        items.extend((k(i), lsn, draw(_values)) for lsn in lsns)
    return items


async def _entries(items: Sequence[tuple[Key, int, Value]]) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
    for key, lsn, value in items:
        yield key, Lsn(lsn), encode_value(value), value.will_init


def _summary(st: KeyState) -> tuple[bool, bool, object, list[object]]:
    return st.complete, st.missing, st.img, list(st.records)


async def _compare_paths(
    layer: PersistentLayer,
    keys: list[Key],
    floor: int,
    cont: int,
    cached: dict[Key, int],
    max_bytes: int,
) -> None:
    def seeded(key: Key) -> KeyState:
        lsn = cached.get(key, -1)
        return KeyState(lsn, b"cached" if lsn >= 0 else None)

    any_cached = bool(cached)
    # general multi-key plan
    states = {key: seeded(key) for key in keys}
    for st in states.values():
        st.pending = []
    ctx = ReadContext(max_vectored_read_bytes=max_bytes, any_cached=any_cached)
    remaining = await layer.plan_reads(keys, floor, cont, states, ctx)
    await read_and_resolve(ctx, states.values())
    assert list(remaining) == [key for key in keys if not states[key].complete]
    # nothing is read that the keys do not use (none below a will_init, none cached)
    assert ctx.blobs_read == sum(len(st.records) + (st.img is not None) for st in states.values())
    for key in keys:
        # the single-key path
        one = seeded(key)
        one.pending = []
        ctx1 = ReadContext(max_vectored_read_bytes=max_bytes, any_cached=any_cached)
        await layer.plan_key(key, floor, cont, one, ctx1)
        if any_cached:
            one.floor_reached(floor)
        await read_and_resolve(ctx1, [one])
        assert ctx1.blobs_read == len(one.records) + (one.img is not None)
        # the legacy oracle, as ``get_legacy`` reads a layer for a key with a cached page
        legacy = seeded(key)
        cached_floor = legacy.cached_lsn + 1 if legacy.cached_lsn >= 0 else 0
        if cont <= cached_floor:
            legacy.complete = True
        else:
            await layer.get_value_legacy(key, max(floor, cached_floor), cont, legacy)
            if not legacy.complete and max(floor, cached_floor) <= cached_floor:
                legacy.complete = True
        assert _summary(states[key]) == _summary(legacy), key
        assert _summary(one) == _summary(legacy), key


@settings(max_examples=40, deadline=None)
@given(
    items=_layer_items(),
    picks=hst.lists(hst.integers(0, 9), min_size=1, max_size=10, unique=True),
    window=hst.tuples(hst.integers(95, 141), hst.one_of(hst.integers(1, 50), hst.integers(150, 300))),
    cached=hst.dictionaries(hst.integers(0, 9), hst.integers(95, 145), max_size=4),
    max_bytes=hst.sampled_from([16, 64, 128 * 1024]),
)
def test_plan_reads_and_plan_key_agree_with_legacy(
    items: list[tuple[Key, int, Value]],
    picks: list[int],
    window: tuple[int, int],
    cached: dict[int, int],
    max_bytes: int,
) -> None:
    floor, width = window
    cont = floor + width
    keys = sorted(k(i) for i in picks)
    cached_keys = {k(i): lsn for i, lsn in cached.items()}
    directory = Path(tempfile.mkdtemp(prefix="pagestore-fast-"))

    async def main() -> None:
        engine = BlockingIoEngine()
        path = await write_delta_layer(
            engine, directory, KeyRange(k(0), k(10)), Lsn(100), Lsn(140 + ENTRIES_PER_BLOCK), _entries(items)
        )
        if path is None:
            return
        # a small index cache: blocks are evicted and re-read mid-walk
        layer = await PersistentLayer.open(engine, path, IndexBlockCache(2))
        try:
            await _compare_paths(layer, keys, floor, cont, cached_keys, max_bytes)
        finally:
            await layer.aclose()

    try:
        trio.run(main)
    finally:
        shutil.rmtree(directory)


@settings(max_examples=25, deadline=None)
@given(
    present=hst.sets(hst.integers(0, 9), max_size=10),
    picks=hst.lists(hst.integers(0, 11), min_size=1, max_size=12, unique=True),
    cached=hst.dictionaries(hst.integers(0, 11), hst.integers(40, 60), max_size=4),
)
def test_image_layer_fast_paths_agree_with_legacy(
    present: set[int], picks: list[int], cached: dict[int, int]
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="pagestore-fast-"))

    async def images() -> AsyncIterator[tuple[Key, bytes]]:
        for i in sorted(present):
            yield k(i), b"page%d" % i

    async def main() -> None:
        engine = BlockingIoEngine()
        path = await write_image_layer(engine, directory, KeyRange(k(0), k(12)), Lsn(50), images())
        if path is None:
            return
        layer = await PersistentLayer.open(engine, path, IndexBlockCache(4))
        try:
            await _compare_paths(layer, sorted(k(i) for i in picks), 50, 60, {k(i): v for i, v in cached.items()},
                                 128 * 1024)
        finally:
            await layer.aclose()

    try:
        trio.run(main)
    finally:
        shutil.rmtree(directory)


async def test_single_key_across_index_blocks(tmp_path: Path) -> None:
    """A key with more versions than an index block holds: ``plan_key`` must go on into the
    next block (here through ``plan_reads``) and take the newest versions."""
    engine = BlockingIoEngine()
    n = ENTRIES_PER_BLOCK + 60
    items: list[tuple[Key, int, Value]] = [(k(0), 100 + i, TestRecord.wal_append(".")) for i in range(50)]
    items.append((k(1), 100, Image(b"base")))
    items.extend((k(1), 101 + i, TestRecord.wal_append(f",{i}")) for i in range(n))
    path = await write_delta_layer(engine, tmp_path, KeyRange(k(0), k(2)), Lsn(100), Lsn(101 + n), _entries(items))
    assert path is not None
    layer = await PersistentLayer.open(engine, path, IndexBlockCache(8))
    assert layer.reader.summary.n_index_blocks >= 2
    for floor, cont in ((100, 101 + n), (100, 101 + n // 2), (120, 101 + n), (200, 240)):
        await _compare_paths(layer, [k(1)], floor, cont, {}, 128 * 1024)
        await _compare_paths(layer, [k(0), k(1)], floor, cont, {k(1): 150}, 128 * 1024)
    await layer.aclose()


async def test_hostile_blobs_fail_like_decode_value(tmp_path: Path) -> None:
    """``execute_reads`` decodes inline; what ``decode_value`` rejects it rejects the same way."""
    engine = BlockingIoEngine()
    for blob in (b"\x63junk", b"", b"\x08\x00", b"\x01\x07x"):
        async def entries(b: bytes = blob) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
            yield k(0), Lsn(10), b, False

        directory = tmp_path / f"d{len(blob)}{blob[:1].hex()}"
        directory.mkdir()
        path = await write_delta_layer(engine, directory, KeyRange(k(0), k(1)), Lsn(10), Lsn(11), entries())
        assert path is not None
        layer = await PersistentLayer.open(engine, path, IndexBlockCache(4))
        with pytest.raises(RemoteProtocolError) as expected:
            decode_value(blob)
        st = KeyState()
        st.pending = []
        ctx = ReadContext()
        await layer.plan_reads([k(0)], 10, 11, {k(0): st}, ctx)
        with pytest.raises(RemoteProtocolError) as got:
            await read_and_resolve(ctx, [st])
        assert str(got.value) == str(expected.value)
        assert got.value.sqlstate == "XX001"
        await layer.aclose()


# -- layer map: search_span and read_candidates ---------------------------------------------------


class _FakeLayer:
    """The layer map only looks at ``desc``."""

    def __init__(self, desc: LayerDesc) -> None:
        self.desc = desc

    def __repr__(self) -> str:
        return f"<{self.desc}>"


@hst.composite
def _layer_maps(draw: hst.DrawFn) -> LayerMap:
    lm = LayerMap()
    lsn = 10
    for _ in range(draw(hst.integers(1, 6))):
        # deltas: L0s over everything, or a compaction's L1s sharing one LSN range
        width = draw(hst.integers(1, 10))
        if draw(hst.integers(0, 2)) == 0:
            descs = [LayerDesc(KeyRange.full(), Lsn(lsn), Lsn(lsn + width), True)]
        else:
            cuts = sorted(draw(hst.sets(hst.integers(1, 19), max_size=3)))
            bounds = [0, *cuts, 20]
            descs = [
                LayerDesc(KeyRange(k(a), k(b)), Lsn(lsn), Lsn(lsn + width), True)
                for a, b in itertools.pairwise(bounds)
                if draw(hst.booleans())
            ]
        lsn += width
        if draw(hst.booleans()):
            a = draw(hst.integers(0, 18))
            b = draw(hst.integers(a + 1, 20))
            descs.append(LayerDesc(KeyRange(k(a), k(b)), Lsn(lsn - 1), Lsn(lsn), False))
        for desc in descs:
            lm.insert(cast(PersistentLayer, _FakeLayer(desc)))
    return lm


@settings(max_examples=400, deadline=None)
@given(
    lm=_layer_maps(),
    queries=hst.lists(
        hst.tuples(hst.integers(0, 19), hst.integers(0, 6), hst.integers(5, 80)), min_size=1, max_size=8
    ),
)
def test_search_span_is_search_for_every_key(lm: LayerMap, queries: list[tuple[int, int, int]]) -> None:
    # twice over: the second round may be answered from search_span's memo of whole-key-space
    # answers, which must hold for any span
    for first, span, end_lsn in queries + queries[::-1]:
        last = min(19, first + span)
        got = lm.search_span(k(first), k(last), end_lsn)
        if first == last:
            assert got == lm.search(k(first), end_lsn)
        if got is not None:
            for i in range(first, last + 1):
                assert lm.search(k(i), end_lsn) == got, i
        elif first != last:
            # None: no layer for any key, or the answer differs somewhere, or a layer ends inside
            answers = {lm.search(k(i), end_lsn) for i in range(first, last + 1)}
            edges = {x.desc.key_range.start for x in lm} | {x.desc.key_range.end for x in lm}
            assert answers == {None} or len(answers) > 1 or any(k(first) < e <= k(last) for e in edges)


@settings(max_examples=200, deadline=None)
@given(lm=_layer_maps(), first=hst.integers(0, 19), span=hst.integers(0, 6), end_lsn=hst.integers(5, 80))
def test_read_candidates_name_every_layer_a_walk_visits(
    lm: LayerMap, first: int, span: int, end_lsn: int
) -> None:
    last = min(19, first + span)
    candidates = {id(x) for x in lm.read_candidates(k(first), k(last), end_lsn, 1000)}
    for i in range(first, last + 1):
        cont = end_lsn
        while (hit := lm.search(k(i), cont)) is not None:
            layer, floor = hit
            assert id(layer) in candidates, (i, layer)
            if not layer.desc.is_delta:
                break  # an image ends the key's walk (present: its page; absent: missing)
            cont = floor


# -- cold reads and the single-key walk -----------------------------------------------------------


async def test_cold_vectored_reads_prefetch_and_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = BlockingIoEngine()
    items: list[tuple[Key, int, Value]] = []
    for i in range(400):
        items.append((k(i), 100, Image(bytes([i % 251]) * 700)))
        items.extend((k(i), lsn, TestRecord.wal_append(f",{i}.{lsn}")) for lsn in (110, 120) if i % 3)
    path = await write_delta_layer(engine, tmp_path, KeyRange(k(0), k(400)), Lsn(100), Lsn(130), _entries(items))
    assert path is not None
    layer = await PersistentLayer.open(engine, path, IndexBlockCache(64))
    keys = [k(i) for i in range(0, 400, 7)]  # scattered: many separate reads
    fd = layer.reader.file.fd
    os.fsync(fd)

    async def vectored() -> dict[Key, tuple[bool, bool, object, list[object]]]:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        states = {key: KeyState() for key in keys}
        for st in states.values():
            st.pending = []
        ctx = ReadContext(max_vectored_read_bytes=4096)
        engine.stats.reset()
        await layer.plan_reads(keys, 0, 130, states, ctx)
        assert len(ctx.reads) > 1
        n_reads = len(ctx.reads)
        await read_and_resolve(ctx, states.values())
        assert engine.stats.preadvs >= n_reads
        return {key: _summary(st) for key, st in states.items()}

    prefetched: list[tuple[int, int, int]] = []
    real_fadvise = os.posix_fadvise

    def spy(fd_: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            prefetched.append((fd_, offset, length))
        real_fadvise(fd_, offset, length, advice)

    # The prefetch is seen through the twin (the compiled kernel calls posix_fadvise from C,
    # where no spy reaches); the compiled one must then read the same cold batch the same.
    selected = delta_layer._gather_blobs
    monkeypatch.setattr(delta_layer, "_gather_blobs", _blobs_py.gather_blobs)
    monkeypatch.setattr(os, "posix_fadvise", spy)
    cold = await vectored()
    if delta_layer._nowait[0]:
        assert prefetched, "a cold batch asks the kernel for its reads at once"
    monkeypatch.setattr(delta_layer, "_gather_blobs", selected)
    assert await vectored() == cold
    monkeypatch.setattr(delta_layer, "_nowait", [False])  # plain preadvs, no probe
    plain = await vectored()
    assert cold == plain
    for key in keys:
        legacy = KeyState()
        await layer.get_value_legacy(key, 0, 130, legacy)
        assert cold[key] == _summary(legacy)
    await layer.aclose()


async def test_single_key_walk_serves_get_and_cold_index_prefetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = StorageConfig(
        validate_get=True, double_buffering=False, compaction_threshold=1_000, page_cache_size=1 << 20,
        index_cache_blocks=8,
    )
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    tl = await tenant.create_timeline(TimelineId.generate())
    lsn = 0
    model: dict[tuple[int, int], bytes] = {}
    pages: dict[int, bytes] = {}
    for layer in range(6):
        for i in range(0, 300, 1 + layer):
            lsn += 1
            if layer == 0:
                await tl.put(k(i), Lsn(lsn), Image(b"p%d" % i))
                pages[i] = b"p%d" % i
            else:
                await tl.put(k(i), Lsn(lsn), TestRecord.wal_append(f",{layer}"))
                pages[i] += f",{layer}".encode()
            tl.finish_write(Lsn(lsn))
            model[(i, lsn)] = pages[i]
        if layer < 5:
            await tl.flush()  # the last layer stays in memory
    walks: list[Key] = []
    real_walk_one = read_path._walk_one
    prefetches: list[int] = []
    real_prefetch = read_path._prefetch_index

    async def walk_one(tl_: read_path.ReadableTimeline, key: Key, *args: object) -> None:
        walks.append(key)
        await real_walk_one(tl_, key, *args)  # type: ignore[arg-type]

    def prefetch(*args: object) -> None:
        prefetches.append(1)
        real_prefetch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(read_path, "_walk_one", walk_one)
    monkeypatch.setattr(read_path, "_prefetch_index", prefetch)
    for i in range(0, 300, 13):
        for at in (lsn, lsn // 2, lsn // 3):
            expected = max(((j, x) for (j, x) in model if j == i and x <= at), default=None)
            if expected is None:
                continue
            # validate_get: the legacy path runs too and must agree
            assert await tl.get(k(i), Lsn(at)) == model[expected]
    assert walks, "single-key reads take the single-key walk"
    # the index cache holds 8 blocks of 5+ layer files: walks find it cold and prefetch
    assert prefetches
    await tenant.shutdown()


# -- reconstruct: the append-only fast path of apply_test_records ---------------------------------


def _model_apply(base: bytes | None, records: list[tuple[Lsn, WalRecordValue]]) -> bytes | str:
    """Test record semantics written out plainly; an error is its message's kind."""
    page = base or b""
    for _lsn, rec in records:
        if not isinstance(rec, TestRecord):
            return "no redo"
        if rec.will_init and (not rec.clear or page):
            return "will_init"
        if rec.clear:
            page = b""
        if rec.only_if is not None and page != rec.only_if.encode():
            return "only_if"
        page = page + rec.append.encode()
    return page


_records = hst.one_of(
    hst.builds(TestRecord.wal_append, hst.text("ab", max_size=3)),
    hst.builds(TestRecord.wal_clear, hst.text("ab", max_size=3)),
    hst.builds(TestRecord.wal_init, hst.text("ab", max_size=3)),
    hst.builds(TestRecord.wal_append_conditional, hst.text("ab", max_size=3), hst.text("ab", max_size=3)),
    hst.builds(PostgresRecord, hst.booleans(), hst.binary(max_size=3)),
)


@settings(max_examples=300, deadline=None)
@given(
    base=hst.one_of(hst.none(), hst.binary(max_size=4)),
    recs=hst.lists(hst.one_of(_records, _records.filter(lambda r: isinstance(r, TestRecord))), max_size=5),
)
def test_apply_test_records_matches_the_model(base: bytes | None, recs: list[WalRecordValue]) -> None:
    records = [(Lsn(10 + i), rec) for i, rec in enumerate(recs)]
    expected = _model_apply(base, records)
    if isinstance(expected, bytes):
        assert apply_test_records(k(0), base, records) == expected
    else:
        with pytest.raises(PageReconstructError) as info:
            apply_test_records(k(0), base, records)
        assert expected in str(info.value)
