"""The image kernel (``_images_c.read_images``, twin ``_images_py``) and the fast path it gives
``Timeline.get_pages`` / ``get_page``.

- The fast path answers exactly what the general walk answers: random timelines (page-sized
  images, Test records to redo, freezes, flushes, compactions, image layers, sometimes a branch;
  page cache on and off) read in batches at one LSN, at mixed LSNs and one by one, with the fast
  path on and off (``Timeline.image_fast_path``), the same bytes or the same error class and
  message; and it is taken (``Timeline.image_fast_pages``), on a timeline of images every key.
- Kernel against twin on real layer files: the same pages, block-cache hits and LRU order,
  ``preadv`` calls and bytes; hostile index blocks (random bytes over the raw entries, entries
  cut short, raw entries that are not bytes), hostile blobs (a flipped byte: CRC; a file cut
  short), bad arguments: the same result or the same error class.
"""

from __future__ import annotations

import copy
import os
import random
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pageserver.page_service.config import PageServiceConfig, PipelinedPipelining, SerialPipelining
from pageserver.page_service.reader import PageRead
from pageserver.page_service.timeline_adapter import TimelinePageReader
from pageserver.storage import _images_select, read_path
from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.layer_file import DATA_START
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.storage.value import Image, TestRecord, Value
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol import _native
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.pagestream import GetPageRequest, NblocksRequest, RelTag
from tests.conftest import kernel
from tests.fuzz_helpers import harness_takes_its_seeds_and_catches
from tests.pageserver.test_page_service_timeline import NBLOCKS, REL, build_timeline, page, serve

BLCKSZ = 8192
KEYS = [rel_block_key(1663, 5, 1000 + i // 16, 0, i % 16) for i in range(48)]
Result = bytes | PageReconstructError
# the implementations this process can load (PAGESTORE_PURE_PYTHON=1: the twin only)
IMPLS = ["python"] if _native.IMPL == "python" else ["native", "python"]


def _page(text: str) -> bytes:
    raw = text.encode()
    return (raw * (BLCKSZ // len(raw) + 1))[:BLCKSZ]


def _config(cache: bool, index_blocks: int = 64) -> StorageConfig:
    return StorageConfig(
        checkpoint_distance=64 * 1024,
        compaction_threshold=3,
        compaction_target_size=BLCKSZ * 20,
        image_creation_threshold=2,
        gc_horizon=10_000,
        pitr_interval_s=3600,
        validate_get=False,
        page_cache_size=(4 << 20) if cache else 0,
        index_cache_blocks=index_blocks,
        write_buffer_size=4096,
        double_buffering=False,
    )


async def _put(tl: Timeline, ops: list[tuple[int, Key, Value]], writes: list[tuple[int, str]], step: int) -> None:
    lsn = Lsn(tl.last_record_lsn + step)
    done: set[Key] = {k for _, k, _ in ops}
    batch: dict[Key, Value] = {}
    for ki, kind in writes:
        key = KEYS[ki]
        if kind == "img" or key not in done:
            batch.setdefault(key, Image(_page(f"{ki}@{lsn};")))
        else:
            batch.setdefault(key, TestRecord.wal_append(f",{lsn}"))
    for key, value in batch.items():
        await tl.put(key, lsn, value)
    tl.finish_write(lsn)
    ops.extend((lsn, key, value) for key, value in batch.items())


WRITES = st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.sampled_from(["img", "img", "append"])),
                  min_size=1, max_size=16)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), WRITES, st.integers(1, 30)),
        st.tuples(st.sampled_from(["freeze", "flush", "compact", "images"]), st.just([]), st.just(0)),
    ),
    min_size=4,
    max_size=30,
)


async def _build(tenant: Tenant, spec: list[tuple[str, list[tuple[int, str]], int]]) -> tuple[Timeline, list[tuple[int, Key, Value]]]:
    tid = TimelineId.generate()
    tl = await tenant.create_timeline(tid)
    ops: list[tuple[int, Key, Value]] = []
    for kind, writes, step in spec:
        if kind == "put":
            await _put(tl, ops, writes, step)
        elif kind == "freeze":
            await tl.freeze()
        elif kind == "flush":
            await tl.flush()
        elif kind == "compact":
            await tl.compact()
        else:
            await tl.flush()
            await tl.compact(force_image=True)
    return tl, ops


def _equal(a: Result, b: Result) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    return type(a) is type(b) and str(a) == str(b)


async def _both(tl: Timeline, read: Callable[..., Awaitable[Any]], *args: Any) -> tuple[Any, Any, int]:
    """``read(*args)`` with the fast path off, then on: (general, fast, pages the kernel gave)."""
    before = tl.image_fast_pages
    tl.image_fast_path = False
    try:
        general = await read(*args)
    finally:
        tl.image_fast_path = True
    assert tl.image_fast_pages == before
    fast = await read(*args)
    return general, fast, tl.image_fast_pages - before


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=OPS, cache=st.booleans(), branch=st.booleans(), impl=st.sampled_from(IMPLS),
       data=st.data())
def test_fast_path_answers_what_the_walk_answers(
    spec: list[tuple[str, list[tuple[int, str]], int]], cache: bool, branch: bool, impl: str,
    data: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory(prefix="pagestore-images-") as d:
        tenant = Tenant(Path(d), TenantId.generate(), _config(cache))

        async def go() -> None:
            tl, ops = await _build(tenant, [("put", [(i, "img") for i in range(0, len(KEYS), 2)], 5), *spec])
            if branch:
                child = await tenant.create_timeline(TimelineId.generate(), ancestor=tl,
                                                     ancestor_lsn=tl.last_record_lsn)
                await _put(child, list(ops), [(i, "img") for i in range(0, len(KEYS), 5)], 3)
                if data.draw(st.booleans(), label="flush child"):
                    await child.flush()
                tl = child
            lo, hi = max(1, int(tl.ancestor_lsn)), int(tl.last_record_lsn)
            served = 0
            for _ in range(4):
                lsn = Lsn(data.draw(st.integers(lo, hi), label="lsn"))
                keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=20, unique=True), label="keys")
                general, fast, n = await _both(tl, tl.get_pages, [(k, lsn) for k in keys])
                served += n
                for k, a, b in zip(keys, general, fast, strict=True):
                    assert _equal(a, b), (k.hex(), lsn, a, b)
                one, one_fast, n = await _both(tl, tl.get_page, keys[0], lsn)
                served += n
                assert _equal(one, one_fast), (keys[0].hex(), lsn, one, one_fast)
                assert _equal(one, general[0])
                mixed = [(k, Lsn(data.draw(st.integers(lo, hi), label="mixed lsn"))) for k in keys]
                general, fast, _ = await _both(tl, tl.get_pages, mixed)
                for (k, lsn_k), a, b in zip(mixed, general, fast, strict=True):
                    assert _equal(a, b), (k.hex(), lsn_k, a, b)
            event(f"served any: {served > 0}")

        read_path._read_images = kernel(impl, "pageserver.storage._images_c").read_images
        try:
            trio.run(go)
        finally:
            read_path._read_images = _images_select.read_images
            trio.run(tenant.shutdown)


async def _image_timeline(tmp_path: Path, cache: bool = False) -> tuple[Tenant, Timeline, list[tuple[int, Key, Value]]]:
    tenant = Tenant(tmp_path, TenantId.generate(), _config(cache))
    tl, ops = await _build(tenant, [("put", [(i, "img") for i in range(len(KEYS))], 5), ("flush", [], 0)])
    await tl.compact(force_image=True)
    return tenant, tl, ops


@pytest.mark.parametrize("impl", IMPLS)
async def test_fast_path_serves_every_image(tmp_path: Path, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_path, "_read_images", kernel(impl, "pageserver.storage._images_c").read_images)
    tenant, tl, _ops = await _image_timeline(tmp_path)
    lsn = tl.last_record_lsn
    general, fast, served = await _both(tl, tl.get_pages, [(k, lsn) for k in KEYS])
    assert fast == general and all(isinstance(p, bytes) and len(p) == BLCKSZ for p in fast)
    # the first batch may find index blocks cold (declined, then the walk loads them)
    general, fast, served = await _both(tl, tl.get_pages, [(k, lsn) for k in KEYS])
    assert fast == general and served == len(KEYS)
    one, one_fast, served = await _both(tl, tl.get_page, KEYS[3], lsn)
    assert one == one_fast == general[3] and served == 1
    misses = tl.page_cache.misses
    await tl.get_pages([(k, lsn) for k in KEYS])
    assert tl.page_cache.misses == misses + len(KEYS)  # counted as the lookups would
    await tenant.shutdown()


# -- kernel against twin on real layer files ---------------------------------------------------


def _call(impl: str, layer: PersistentLayer, blocks: Any, keys: list[Any], cont: Any, floor: Any,
          data_end: Any = None, fd: int | None = None) -> tuple[str, Any]:
    r = layer.reader
    fn = kernel(impl, "pageserver.storage._images_c").read_images
    args = (r.fences, r.summary.n_index_blocks, blocks, r.file_id, keys, cont, floor, DATA_START,
            r.summary.data_end if data_end is None else data_end, r.file.fd if fd is None else fd)
    try:
        got = fn(*args)
    except Exception as exc:
        return "error", type(exc)
    # the same read into a response buffer (slots in reverse order, a header's room before
    # each): the same pages there, the same flags, and the same bytes everywhere in it
    stride = BLCKSZ + 47
    out = bytearray(b"\xa5" * (7 + stride * len(keys)))
    into = kernel(impl, "pageserver.storage._images_c").read_images_into(
        *args, out, 7, stride, list(range(len(keys)))[::-1])
    pages = got[0]
    assert into[0] == bytes(p is not None for p in pages) and into[1:] == got[1:]
    for i, p in enumerate(pages):
        if p is not None:
            at = 7 + (len(keys) - 1 - i) * stride
            assert out[at : at + BLCKSZ] == p
    return "ok", (got, list(blocks), bytes(out))


async def _loaded(layer: PersistentLayer) -> OrderedDict[tuple[int, int], Any]:
    r = layer.reader
    blocks: OrderedDict[tuple[int, int], Any] = OrderedDict()
    for blkno in range(r.summary.n_index_blocks):
        blocks[(r.file_id, blkno)] = await r.block(blkno)
    return blocks


def _both_kernels(layer: PersistentLayer, blocks: Any, *args: Any, **kw: Any) -> tuple[str, Any]:
    a = _call("native", layer, copy.copy(blocks), *args, **kw)
    b = _call("python", layer, copy.copy(blocks), *args, **kw)
    assert a == b, (a, b)
    return a


@pytest.mark.native
async def test_kernel_equals_twin_on_layers(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), _config(False, index_blocks=4096))
    spec: list[tuple[str, list[tuple[int, str]], int]] = [
        ("put", [(i, "img") for i in range(len(KEYS))], 5),
        ("put", [(i, "append") for i in range(0, len(KEYS), 3)], 5),
        ("put", [(i, "img") for i in range(0, len(KEYS), 4)], 5),
        ("flush", [], 0),
    ]
    tl, _ops = await _build(tenant, spec)
    layers = list(tl.layer_map)
    await tl.compact(force_image=True)
    layers += [x for x in tl.layer_map if x not in layers]
    rng = random.Random(7)
    served = 0
    for layer in layers:
        blocks = await _loaded(layer)
        d = layer.desc
        for _ in range(30):
            keys = rng.sample([*KEYS, b"\x00" * 18, b"\xff" * 18], rng.randint(1, 20))
            if rng.random() < 0.5:
                keys.sort()
            cont = rng.randint(int(d.lsn_start), int(d.lsn_end) + 3)
            floor = rng.randint(0, int(d.lsn_start) + 1)
            kind, got = _both_kernels(layer, blocks, keys, cont, floor)
            assert kind == "ok"
            served += len(got[0][0]) - got[0][0].count(None)
    assert served > 100
    # bad arguments
    layer = layers[-1]
    blocks = await _loaded(layer)
    bad: list[tuple[list[Any], int, int]] = [([b"short"], 10, 0), ([KEYS[0]], -1, 0), ([KEYS[0]], 1 << 64, 0),
                                             ([KEYS[0]], 10, -1), ([bytearray(18)], 10, 0)]
    for bad_keys, cont, floor in bad:
        assert _both_kernels(layer, blocks, bad_keys, cont, floor) == ("error", ValueError)
    assert _both_kernels(layer, blocks, [KEYS[0]], 10**9, 0, data_end=-1) == ("error", ValueError)
    assert _both_kernels(layer, blocks, KEYS, 10**9, 0, fd=10**6) == ("error", OSError)  # EBADF
    # the response buffer's bounds and type: the same error from both, before anything is read
    r = layer.reader
    for out, dest, stride, slots in [(bytearray(BLCKSZ), 0, BLCKSZ - 1, [0]), (bytearray(BLCKSZ), -1, BLCKSZ, [0]),
                                     (bytearray(BLCKSZ), 1, BLCKSZ, [0]), (bytearray(2 * BLCKSZ), 0, BLCKSZ, [2]),
                                     (bytearray(2 * BLCKSZ), 0, BLCKSZ, [-1]), (bytearray(2 * BLCKSZ), 0, BLCKSZ, []),
                                     (bytes(BLCKSZ), 0, BLCKSZ, [0]), (bytearray(), 0, BLCKSZ, [0])]:
        outcomes = []
        for impl in IMPLS:
            fn = kernel(impl, "pageserver.storage._images_c").read_images_into
            with pytest.raises((ValueError, TypeError)) as caught:
                fn(r.fences, r.summary.n_index_blocks, blocks, r.file_id, [KEYS[0]], 10**9, 0, DATA_START,
                   r.summary.data_end, r.file.fd, out, dest, stride, slots)
            outcomes.append(caught.type)
        assert len(set(outcomes)) == 1, (dest, stride, slots, outcomes)
    await tenant.shutdown()


class _Block:
    def __init__(self, raw: Any, n: int) -> None:
        self.raw = raw
        self.prefixes = [b""] * n


@pytest.mark.native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_kernel_equals_twin_on_hostile_indexes(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("hostile")

    async def go() -> None:
        tenant, tl, _ops = await _image_timeline(tmp)
        layer = next(x for x in tl.layer_map if not x.desc.is_delta)
        good = await _loaded(layer)
        blocks: OrderedDict[tuple[int, int], Any] = OrderedDict()
        for ident, block in good.items():
            raw = bytearray(block.raw)
            what = data.draw(st.sampled_from(["keep", "flip", "cut", "random", "type"]), label="damage")
            n = len(raw) // 42
            if what == "flip" and raw:
                for _ in range(data.draw(st.integers(1, 8))):
                    at = data.draw(st.integers(0, len(raw) - 1))
                    raw[at] ^= 1 << data.draw(st.integers(0, 7))
            elif what == "cut":
                raw = raw[: data.draw(st.integers(0, len(raw)))]
            elif what == "random":
                raw = bytearray(data.draw(st.binary(min_size=0, max_size=42 * 6)))
                n = len(raw) // 42 if data.draw(st.booleans()) else n
            blocks[ident] = _Block(bytearray(raw) if what == "type" else bytes(raw), n)
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=12))
        cont = data.draw(st.integers(0, int(tl.last_record_lsn) + 5))
        _both_kernels(layer, blocks, keys, cont, data.draw(st.integers(0, cont)))
        await tenant.shutdown()

    trio.run(go)


@pytest.mark.native
async def test_kernel_equals_twin_on_hostile_blobs(tmp_path: Path) -> None:
    tenant, tl, _ops = await _image_timeline(tmp_path)
    layer = next(x for x in tl.layer_map if not x.desc.is_delta)
    blocks = await _loaded(layer)
    lsn = int(layer.desc.lsn_end)
    keys = [k for k in KEYS if layer.desc.key_range.start <= k < layer.desc.key_range.end]
    assert len(keys) >= 10
    _kind, (got, _, _) = _both_kernels(layer, blocks, keys, lsn, 0)
    assert got[0].count(None) == 0
    path = layer.path
    size = os.path.getsize(path)
    rng = random.Random(3)
    with open(path, "r+b") as f:
        for at in rng.sample(range(DATA_START, layer.reader.summary.data_end), 5):
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))
    _kind, (got, _, _) = _both_kernels(layer, blocks, keys, lsn, 0)
    assert 0 < got[0].count(None) <= 5
    # a file cut inside its data: the reads past the end come back short (declined)
    os.truncate(path, DATA_START + (layer.reader.summary.data_end - DATA_START) // 2)
    _kind, (got, _, _) = _both_kernels(layer, blocks, keys, lsn, 0)
    assert got[0].count(None) >= len(keys) // 2 - 5
    assert size > 0
    await tenant.shutdown()


@pytest.mark.parametrize("impl", IMPLS)
async def test_fast_path_follows_keys_down_the_deltas(tmp_path: Path, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench getpage``'s timeline: every page in one L0 layer, a tenth rewritten in the next:
    the keys the top layer has nothing of are found one layer down; a Test record on top of
    an image (redo) and a key nobody wrote are the general path's."""
    monkeypatch.setattr(read_path, "_read_images", kernel(impl, "pageserver.storage._images_c").read_images)
    tenant = Tenant(tmp_path, TenantId.generate(), _config(False))
    spec: list[tuple[str, list[tuple[int, str]], int]] = [
        ("put", [(i, "img") for i in range(len(KEYS) - 1)], 5), ("flush", [], 0),
        ("put", [(i, "img") for i in range(0, len(KEYS) - 1, 10)], 5), ("flush", [], 0),
        ("put", [(7, "append")], 5), ("flush", [], 0),
    ]
    tl, _ops = await _build(tenant, spec)
    assert len(list(tl.layer_map)) == 3 and not tl.in_memory_layers()
    lsn = tl.last_record_lsn
    reads = [(k, lsn) for k in KEYS]
    await tl.get_pages(reads)  # index blocks into the cache
    general, fast, served = await _both(tl, tl.get_pages, reads)
    assert all(_equal(a, b) for a, b in zip(general, fast, strict=True))
    assert served == len(KEYS) - 2  # not KEYS[7] (redo) nor KEYS[-1] (missing)
    assert isinstance(fast[-1], PageReconstructError) and isinstance(fast[7], bytes) and len(fast[7]) > BLCKSZ
    # at the first layer's LSN the rewrites are not visible yet
    old = [(k, Lsn(5)) for k in KEYS]
    general, fast, served = await _both(tl, tl.get_pages, old)
    assert all(_equal(a, b) for a, b in zip(general, fast, strict=True)) and served == len(KEYS) - 1
    await tenant.shutdown()


async def test_page_reader_batches_take_the_fast_path(tmp_path: Path) -> None:
    """``TimelinePageReader.get_pages`` (one fork at one LSN: ``Timeline.get_pages_at``) gives
    what the general path gives: pages in two layers, blocks past the fork's end (zeros), a
    missing relation, a batch of two forks; and the kernel answers the in-range blocks."""
    tenant = await build_timeline(tmp_path)
    tl = next(iter(tenant.timelines.values()))
    await tl.flush()  # version 2 of the even blocks into a second layer
    tl.config = attrs.evolve(tl.config, validate_get=False)  # (validate_get: the general path only)
    reader = TimelinePageReader(tl)
    other = RelTag(1663, 5, 16385, 0)
    batches = [
        [PageRead(REL, b, Lsn(0x200)) for b in range(NBLOCKS)],
        [PageRead(REL, b, Lsn(0x150)) for b in range(0, NBLOCKS, 3)],
        [PageRead(REL, b, Lsn(0x200)) for b in range(NBLOCKS - 2, NBLOCKS + 2)],
        [PageRead(REL, 1, Lsn(0x200)), PageRead(other, 0, Lsn(0x200))],
        [PageRead(REL, 5, Lsn(0x200)), PageRead(REL, 5, Lsn(0x200))],
    ]
    for reads in batches:
        await reader.get_pages(reads)  # sizes and index blocks into their caches
    served = 0
    for reads in batches:
        general, fast, n = await _both(tl, reader.get_pages, reads)
        served += n
        assert len(general) == len(fast) == len(reads)
        for a, b in zip(general, fast, strict=True):
            assert (a == b) if isinstance(a, bytes) else (type(a) is type(b) and str(a) == str(b)), (a, b)
    assert fast[0] == page(5, 1)
    assert served >= NBLOCKS + len(batches[1])
    await tenant.shutdown()


def test_fuzz_harness_takes_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from bench import fuzz
    from pageserver.storage import _images_py

    def lying(*args: Any) -> object:
        pages, absent, *rest = _images_py.read_images(*args)
        return (pages, absent, *rest[:-1], not rest[-1])

    seeds = harness_takes_its_seeds_and_catches("read-images", tmp_path, _images_py,
                                                SimpleNamespace(read_images=lying), 3)
    pages = 0
    for data in seeds:
        outcome = fuzz.images_outcome(_images_py, data)
        assert outcome is not None and outcome[0][0] == "ok"
        result: Any = outcome[0][1]
        pages += sum(p is not None for p in result[0])
    # seed 0: two images; seed 1: each key's newest blob has tag 1 (declined); seed 2: the newest is an image
    assert pages == 2 + 0 + 1
    if _native.IMPL != "python":
        native = kernel("native", "pageserver.storage._images_c")
        rng = random.Random(5)
        for data in seeds:
            for _ in range(40):  # and a sample of their mutations
                cut = bytearray(data[: rng.randint(0, len(data))])
                for _ in range(rng.randint(0, 4)):
                    if cut:
                        cut[rng.randrange(len(cut))] = rng.randrange(256)
                assert fuzz.images_outcome(native, bytes(cut)) == fuzz.images_outcome(_images_py, bytes(cut))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), impl=st.sampled_from(IMPLS))
def test_page_service_answers_the_same_bytes(data: st.DataObject, impl: str,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """The pipeline's batches through ``get_pages_into`` (pages read into their responses'
    slots, the rest filled in or answered one by one) give byte for byte what the general path
    gives, and what serial mode gives: random GetPages over one fork at a few LSNs, blocks past
    its end, a missing relation, other requests between them."""
    tmp = tmp_path_factory.mktemp("pipeline")
    other = RelTag(1663, 5, 16385, 0)
    lsns = [Lsn(0x150), Lsn(0x200), Lsn(0xFFFF_FFFF_FFFF_FFFF)]
    reqs: list[Any] = []
    for i in range(data.draw(st.integers(1, 120), label="requests")):
        kind = data.draw(st.sampled_from(["page"] * 8 + ["past", "missing", "nblocks"]), label="kind")
        lsn = data.draw(st.sampled_from(lsns), label="lsn")
        if kind == "nblocks":
            reqs.append(NblocksRequest(i, lsn, Lsn(0x100), REL))
        else:
            blkno = data.draw(st.integers(0, NBLOCKS - 1), label="blkno") + (NBLOCKS if kind == "past" else 0)
            reqs.append(GetPageRequest(i, lsn, Lsn(0x100), other if kind == "missing" else REL, blkno))

    async def go() -> None:
        tenant = await build_timeline(tmp)
        tl = next(iter(tenant.timelines.values()))
        await tl.flush()
        tl.config = attrs.evolve(tl.config, validate_get=False)
        serial = await serve(tenant, PageServiceConfig(page_service_pipelining=SerialPipelining()), reqs)
        config = PageServiceConfig(page_service_pipelining=PipelinedPipelining(32, "scattered-lsn"))
        tl.image_fast_path = False
        general = await serve(tenant, config, reqs)
        tl.image_fast_path = True
        before = tl.image_fast_pages
        fast = await serve(tenant, config, reqs)
        assert fast == general == serial
        event(f"kernel pages: {tl.image_fast_pages > before}")
        await tenant.shutdown()

    read_path._read_images_into = kernel(impl, "pageserver.storage._images_c").read_images_into
    try:
        trio.run(go)
    finally:
        read_path._read_images_into = _images_select.read_images_into


async def test_page_service_reads_pages_into_their_responses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of one fork at one LSN: every page read by the kernel into its slot (no page
    answered by the general path), the responses those of the general path."""
    tenant = await build_timeline(tmp_path)
    tl = next(iter(tenant.timelines.values()))
    await tl.flush()
    tl.config = attrs.evolve(tl.config, validate_get=False)
    lsn = tl.last_record_lsn
    reqs: list[Any] = [GetPageRequest(0, lsn, lsn, REL, 0)]  # (the first batch caches the size)
    reqs += [GetPageRequest(i, lsn, lsn, REL, i % NBLOCKS) for i in range(1, 1 + 4 * NBLOCKS)]
    config = PageServiceConfig(page_service_pipelining=PipelinedPipelining(NBLOCKS, "scattered-lsn"))
    tl.image_fast_path = False
    general = await serve(tenant, config, reqs)
    tl.image_fast_path = True
    got: list[Any] = []
    real = read_path._read_images_into

    def counting(*args: Any) -> Any:
        out = real(*args)
        got.append(out[0])
        return out

    monkeypatch.setattr(read_path, "_read_images_into", counting)
    fast = await serve(tenant, config, reqs)
    assert fast == general
    assert sum(placed.count(1) for placed in got) >= 3 * NBLOCKS
    await tenant.shutdown()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("v3", [True, False])
def test_encoder_leaves_slots_for_pages(impl: str, v3: bool) -> None:
    """``encode_getpage_responses`` with None pages: the responses framed as with pages, their
    page bytes zero (the slots ``ResponseWriter.reserve_pages`` hands out), in both twins."""
    mod = kernel(impl, "protocol._pagestream_c")
    twin = kernel("python", "protocol._pagestream_c")
    reqs = [GetPageRequest(i, Lsn(0x200 + i), Lsn(0x100), REL, i) for i in range(3)]
    pages: list[bytes | None] = [page(0, 1), None, page(2, 1)]
    a, b = bytearray(b"x"), bytearray(b"x")
    mod.encode_getpage_responses(a, v3, reqs, pages)
    twin.encode_getpage_responses(b, v3, reqs, [p if p is not None else bytes(BLCKSZ) for p in pages])
    assert a == b
