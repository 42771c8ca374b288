"""Review tests of the reworked vectored read path: what the model tests do not interleave.

- ``LayerMap.search_span``'s memo of whole-key-space answers against a memo-free oracle, across
  every kind of layer-map change (flush adding an L0, compaction's replace, image creation, GC
  removal, a reload) interleaved with queries at the same LSNs;
- reads in flight (paused inside their walk on cold index blocks, threadpool engine) while
  flushes, compactions, image creation and GC swap the layer map under them;
- ``_do_reads``: ``RWF_NOWAIT`` partial reads, ``EOPNOTSUPP``, and a file shorter than planned
  (truncated after it was opened) give the right bytes or a ``LayerCorruptionError`` naming
  the file, on every read path alike;
- corruption (a flipped bit in a blob or in an index block) fails every path with the same
  error kind.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.lowlevel
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
from pageserver.storage.io_engine import BlockingIoEngine, ThreadpoolIoEngine
from pageserver.storage.key import Key, KeyRange, rel_block_key
from pageserver.storage.layer_file import (
    IndexBlockCache,
    LayerClosedError,
    LayerCorruptionError,
    LayerDesc,
)
from pageserver.storage.layer_map import LayerMap
from pageserver.storage.reconstruct import KeyState, MissingKeyError
from pageserver.storage.value import Image, TestRecord, Value, encode_value
from pageserver.tenant import Tenant
from pageserver.timeline import TimelineShutdownError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


# -- search_span's memo across layer-map changes --------------------------------------------------


class _FakeLayer:
    """Only what the layer map looks at."""

    def __init__(self, desc: LayerDesc) -> None:
        self.desc = desc

    def __repr__(self) -> str:
        return f"<{self.desc}>"


def _oracle(layers: Sequence[PersistentLayer], key: Key, end_lsn: int) -> tuple[PersistentLayer, int] | None:
    """``search`` of a layer map freshly built from ``layers`` (no memo, no history)."""
    fresh = LayerMap()
    fresh.replace([], list(layers))
    return fresh.search(key, end_lsn)


_ops = hst.lists(
    hst.one_of(
        hst.tuples(hst.just("flush"), hst.integers(1, 6)),
        hst.tuples(hst.just("compact"), hst.integers(0, 3)),
        hst.tuples(hst.just("image"), hst.integers(0, 18)),
        hst.tuples(hst.just("gc"), hst.integers(0, 60)),
        hst.tuples(hst.just("reload"), hst.just(0)),
        hst.tuples(hst.just("query"), hst.integers(0, 70)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, probe=hst.lists(hst.integers(0, 19), min_size=1, max_size=4))
def test_search_span_memo_follows_every_layer_map_change(ops: list[tuple[str, int]], probe: list[int]) -> None:
    lm = LayerMap()
    lsn = 1
    asked: list[int] = []

    def check() -> None:
        # every LSN asked so far again: a stale memo would answer with a layer that is gone
        layers = list(lm)
        for end_lsn in asked:
            for i in probe:
                got = lm.search_span(k(i), k(i), end_lsn)
                assert got == _oracle(layers, k(i), end_lsn), (i, end_lsn, layers)
            whole = lm.search_span(k(0), k(19), end_lsn)
            if whole is not None:
                assert all(whole == _oracle(layers, k(i), end_lsn) for i in range(20))
            if whole is not None:
                assert any(whole[0] is x for x in layers), "an answer names a layer not in the map"

    for op, arg in ops:
        if op == "flush":
            lm.replace([], [cast(PersistentLayer, _FakeLayer(LayerDesc(KeyRange.full(), Lsn(lsn), Lsn(lsn + arg), True)))])
            lsn += arg
        elif op == "compact":
            l0s = lm.l0_layers()
            if l0s:
                lo, hi = l0s[0].desc.lsn_start, l0s[-1].desc.lsn_end
                cuts = [0, *sorted({3 + 5 * j for j in range(arg)}), 20]
                l1s = [
                    cast(PersistentLayer, _FakeLayer(LayerDesc(KeyRange(k(a), k(b)), lo, hi, True)))
                    for a, b in itertools.pairwise(cuts)
                ]
                if arg == 0:  # one L1 over everything (still not an L0: it is not the newest)
                    l1s = [cast(PersistentLayer, _FakeLayer(LayerDesc(KeyRange(k(0), k(20)), lo, hi, True)))]
                lm.replace(l0s, l1s)
        elif op == "image":
            lm.replace([], [cast(PersistentLayer, _FakeLayer(LayerDesc(KeyRange(k(arg), k(arg + 2)), Lsn(lsn - 1), Lsn(lsn), False)))])
        elif op == "gc":
            victims = [x for x in lm if x.desc.lsn_end <= arg]
            lm.replace(victims, [])
        elif op == "reload":
            layers = list(lm)
            lm = LayerMap()
            lm.replace([], layers)
        else:
            asked.append(arg)
            lm.search_span(k(0), k(19), arg)
            for i in probe:
                lm.search_span(k(i), k(i), arg)
        check()


# -- reads in flight while the layer map changes ---------------------------------------------------


N_KEYS = 24


async def test_reads_interleaved_with_flush_compaction_images_and_gc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers pause inside their walks (cold index blocks, threadpool engine: every block read
    is a thread hop) while the maintenance task swaps layers; every result must equal the model
    and no read may touch a closed (or reused) file descriptor."""
    cfg = StorageConfig(
        checkpoint_distance=1 << 30,
        compaction_threshold=4,
        compaction_target_size=8192 * 4,
        image_creation_threshold=2,
        gc_horizon=0,
        pitr_interval_s=0,
        validate_get=True,
        page_cache_size=16 * 1024,
        index_cache_blocks=2,  # cold: walks await block reads
        double_buffering=False,
        write_buffer_size=512,
        max_vectored_read_bytes=200,
    )
    tenant = Tenant(tmp_path, TenantId.generate(), cfg, engine=ThreadpoolIoEngine())
    tl = await tenant.create_timeline(TimelineId.generate())
    rng = random.Random(7)
    history: dict[int, list[tuple[int, bytes]]] = {i: [] for i in range(N_KEYS)}
    lsn = 0
    floor_lsn = 0  # reads start at or above this (GC may have removed what is below)

    def expected(i: int, at: int) -> bytes | None:
        page = None
        for x, p in history[i]:
            if x <= at:
                page = p
        return page

    async def put_round(n: int) -> None:
        nonlocal lsn
        for i in range(N_KEYS):
            lsn += 1
            prev = expected(i, lsn)
            if prev is None or rng.random() < 0.1:
                page = b"img%d.%d" % (i, lsn)
                await tl.put(k(i), Lsn(lsn), Image(page))
            else:
                text = f",{n}"
                await tl.put(k(i), Lsn(lsn), TestRecord.wal_append(text))
                page = prev + text.encode()
            history[i].append((lsn, page))
            tl.finish_write(Lsn(lsn))

    in_flight: list[int] = []  # LSNs of the reads in progress
    finished = False

    for n in range(3):
        await put_round(n)
        await tl.flush()
    errors: list[BaseException] = []
    checked = [0]
    swaps = [0]
    overlapped = [0]
    real_replace = LayerMap.replace

    def counting_replace(self: LayerMap, remove: list[PersistentLayer], add: list[PersistentLayer]) -> None:
        swaps[0] += 1
        real_replace(self, remove, add)

    monkeypatch.setattr(LayerMap, "replace", counting_replace)

    async def reader(seed: int) -> None:
        r = random.Random(seed)
        while not finished:
            # Only LSNs whose records are complete: a put in progress at ``lsn`` would be seen
            # by one of validate_get's two reads and not the other (the page service waits for
            # last_record_lsn before it reads; the timeline's read API does not).
            done = max(1, int(tl.last_record_lsn))
            at = r.randint(max(1, floor_lsn), done)
            pick = sorted(r.sample(range(N_KEYS), r.choice((1, 2, 5, 12))))
            before = swaps[0]
            mixed = r.random() < 0.3
            lsns = [r.randint(max(1, floor_lsn), done) if mixed else at for _ in pick]
            lowest = min(lsns)
            in_flight.append(lowest)
            try:
                if mixed:
                    reqs = [(k(i), Lsn(x)) for i, x in zip(pick, lsns, strict=True)]
                    got_list = await tl.get_pages(reqs)
                    for i, x, res in zip(pick, lsns, got_list, strict=True):
                        want = expected(i, x)
                        if want is not None:
                            assert res == want, (i, x, res, want)
                else:
                    got = await tl.get_vectored_results([k(i) for i in pick], Lsn(at))
                    for i in pick:
                        want = expected(i, at)
                        if want is not None:
                            assert got[k(i)] == want, (i, at, got[k(i)], want)
                checked[0] += 1
                overlapped[0] += swaps[0] != before
            except BaseException as exc:
                errors.append(exc)
                return
            finally:
                in_flight.remove(lowest)
            await trio.lowlevel.checkpoint()

    async def maintenance() -> None:
        nonlocal floor_lsn, finished
        for n in range(3, 15):
            await put_round(n)
            await tl.flush()
            await trio.lowlevel.checkpoint()
            await tl.compact(force_image=n % 3 == 0)
            await trio.lowlevel.checkpoint()
            if n % 4 == 0:
                # Readers from now on stay above the new cutoff, and GC waits for the reads
                # below it to end (a read in flight below the cutoff is a separate finding:
                # test_gc_waits_for_reads_below_its_new_cutoff).
                floor_lsn = lsn
                while any(x < floor_lsn for x in in_flight):
                    await trio.lowlevel.checkpoint()
                await tl.gc()
        finished = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(maintenance)
        for seed in range(3):
            nursery.start_soon(reader, seed)
    if errors:
        raise errors[0]
    assert checked[0] > 0
    assert overlapped[0] > 0, "no read saw the layer map change under it"
    await tenant.shutdown()


# -- _do_reads: RWF_NOWAIT, EOPNOTSUPP, short files ------------------------------------------------


async def _entries(items: Sequence[tuple[Key, int, Value]]) -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
    for key, lsn, value in items:
        yield key, Lsn(lsn), encode_value(value), value.will_init


async def _layer(tmp_path: Path, n: int = 60) -> PersistentLayer:
    engine = BlockingIoEngine()
    items: list[tuple[Key, int, Value]] = []
    for i in range(n):
        items.append((k(i), 100, Image(bytes([65 + i % 26]) * 300)))
        items.extend((k(i), lsn, TestRecord.wal_append(f",{i}.{lsn}")) for lsn in (110, 120))
    path = await write_delta_layer(engine, tmp_path, KeyRange(k(0), k(n)), Lsn(100), Lsn(130), _entries(items))
    assert path is not None
    return await PersistentLayer.open(engine, path, IndexBlockCache(64))


def _deferring(keys: Sequence[Key]) -> dict[Key, KeyState]:
    states = {key: KeyState() for key in keys}
    for st in states.values():
        st.pending = []
    return states


async def _read_all(layer: PersistentLayer, keys: Sequence[Key], how: str) -> dict[Key, tuple[object, list[object]]]:
    """Read ``keys`` below 130 by one path: "vectored", "single" (plan_key) or "legacy"."""
    if how == "legacy":
        out: dict[Key, tuple[object, list[object]]] = {}
        for key in keys:
            st = KeyState()
            await layer.get_value_legacy(key, 0, 130, st)
            out[key] = (st.img, list(st.records))
        return out
    states = _deferring(keys)
    ctx = ReadContext(max_vectored_read_bytes=1024)
    if how == "vectored":
        await layer.plan_reads(list(keys), 0, 130, states, ctx)
    else:
        for key in keys:
            await layer.plan_key(key, 0, 130, states[key], ctx)
    await read_and_resolve(ctx, states.values())
    return {key: (st.img, list(st.records)) for key, st in states.items()}


async def test_nowait_partial_and_unsupported_reads_get_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = await _layer(tmp_path)
    keys = [k(i) for i in range(0, 60, 3)]
    monkeypatch.setattr(delta_layer, "_nowait", [False])
    plain = await _read_all(layer, keys, "vectored")
    assert plain == await _read_all(layer, keys, "legacy")
    real_preadv = os.preadv
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here")
    flags_seen: list[int] = []

    def partial(fd: int, buffers: Sequence[Any], offset: int, flags: int = 0) -> int:
        # the page cache holds only the first half of what is asked (a partial hit)
        flags_seen.append(flags)
        if flags & os.RWF_NOWAIT:
            view = memoryview(buffers[0])
            half = max(1, len(view) // 2)
            return real_preadv(fd, [view[:half]], offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(delta_layer, "_nowait", [True])
    # Syscall faults are injected through os.preadv, which only the twin calls (the compiled
    # blob gather does its preadv2/pread from C; tests/pageserver/test_native_blobs.py
    # compares the two on real files).
    monkeypatch.setattr(delta_layer, "_gather_blobs", _blobs_py.gather_blobs)
    monkeypatch.setattr(os, "preadv", partial)
    assert await _read_all(layer, keys, "vectored") == plain
    assert await _read_all(layer, keys, "single") == plain
    assert any(f & os.RWF_NOWAIT for f in flags_seen)

    def blocking(fd: int, buffers: Sequence[Any], offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "would block")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", blocking)
    assert await _read_all(layer, keys, "vectored") == plain

    def unsupported(fd: int, buffers: Sequence[Any], offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", unsupported)
    assert await _read_all(layer, keys, "vectored") == plain
    assert delta_layer._nowait == [False], "switched off after EOPNOTSUPP"
    monkeypatch.setattr(os, "preadv", real_preadv)
    await layer.aclose()


@pytest.mark.parametrize("cut", ["data", "index"])
@pytest.mark.parametrize("nowait", [True, False])
@pytest.mark.parametrize("how", ["vectored", "single", "legacy"])
async def test_file_truncated_after_open_is_a_corruption_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nowait: bool, how: str, cut: str
) -> None:
    layer = await _layer(tmp_path)
    keys = [k(i) for i in range(60)]
    s = layer.reader.summary
    if cut == "data":
        # index blocks cached first: what is cut is the data the plan points at
        await _read_all(layer, keys[:1], how)
    monkeypatch.setattr(delta_layer, "_nowait", [nowait and hasattr(os, "RWF_NOWAIT")])
    os.truncate(layer.path, s.data_end - 500 if cut == "data" else s.index_start + 100)
    with pytest.raises(LayerCorruptionError) as info:
        await _read_all(layer, keys, how)
    assert str(layer.path) in str(info.value)
    assert info.value.sqlstate == "XX001"
    await layer.aclose()


@pytest.mark.parametrize("where", ["blob", "index"])
@pytest.mark.parametrize("how", ["vectored", "single", "legacy"])
async def test_flipped_bit_fails_every_path_alike(tmp_path: Path, where: str, how: str) -> None:
    layer = await _layer(tmp_path)
    path = layer.path
    s = layer.reader.summary
    await layer.aclose()
    raw = bytearray(path.read_bytes())
    raw[4096 + 40 if where == "blob" else s.index_start + 200] ^= 0x08
    path.write_bytes(bytes(raw))
    layer = await PersistentLayer.open(BlockingIoEngine(), path, IndexBlockCache(64))
    with pytest.raises(LayerCorruptionError) as info:
        await _read_all(layer, [k(i) for i in range(60)], how)
    assert str(path) in str(info.value)
    assert info.value.sqlstate == "XX001"
    await layer.aclose()


async def test_gc_keeps_what_reads_in_flight_need(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read admitted above the old GC cutoff still finds its layers: GC caps its new cutoff at
    the lowest LSN of the reads in flight (instead of removing the L1 the read walks into)."""
    cfg = StorageConfig(
        checkpoint_distance=1 << 30, compaction_threshold=2, image_creation_threshold=1, gc_horizon=0,
        pitr_interval_s=0, validate_get=False, double_buffering=False,
    )
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    tl = await tenant.create_timeline(TimelineId.generate())
    await tl.put(k(0), Lsn(10), Image(b"old"))
    tl.finish_write(Lsn(10))
    await tl.flush()
    await tl.put(k(0), Lsn(20), TestRecord.wal_append(",new"))
    tl.finish_write(Lsn(20))
    await tl.flush()
    await tl.compact()  # an L1 over [1, 21)
    await tl.put(k(0), Lsn(30), Image(b"newest"))
    tl.finish_write(Lsn(30))
    await tl.flush()
    await tl.put(k(0), Lsn(40), TestRecord.wal_append(",more"))
    tl.finish_write(Lsn(40))
    await tl.flush()
    await tl.compact(force_image=True)  # an image at 40: GC may drop the L1 below it
    admitted = trio.Event()
    go_on = trio.Event()
    real = read_path.get_vectored

    async def paused(*args: Any) -> None:
        admitted.set()  # past the GC-cutoff check, before the walk
        await go_on.wait()
        await real(*args)

    monkeypatch.setattr(read_path, "get_vectored", paused)
    result: list[object] = []

    async def read_old() -> None:
        try:
            result.append(await tl.get(k(0), Lsn(15)))
        except Exception as exc:
            result.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_old)
        await admitted.wait()
        removed = await tl.gc()
        go_on.set()
    assert result == [b"old"], (removed, result)
    await tenant.shutdown()



@pytest.mark.parametrize("how", ["planned", "vectored", "single", "legacy"])
async def test_read_of_a_closed_layer_never_uses_its_old_descriptor(tmp_path: Path, how: str) -> None:
    """A layer closed under a read (timeline shutdown): its descriptor number may already be
    another file's, so the read must stop, naming the file, whether it closed between planning
    and reading ("planned") or before an index block or blob read of any path."""
    layer = await _layer(tmp_path)
    keys = [k(i) for i in range(0, 60, 5)]
    states = _deferring(keys)
    ctx = ReadContext(max_vectored_read_bytes=1024)
    if how == "planned":
        await layer.plan_reads(keys, 0, 130, states, ctx)
    old_fd = layer.reader.file.fd
    await layer.aclose()  # (forgets its cached index blocks: the walk reads them again)
    other = os.open(tmp_path / "other", os.O_CREAT | os.O_RDWR)
    try:
        os.write(other, bytes(range(256)) * 1000)  # readable bytes where the layer's were
        assert other == old_fd  # (the lowest free number: the layer's)
        with pytest.raises(LayerClosedError) as info:
            if how == "planned":
                await read_and_resolve(ctx, states.values())
            else:
                await _read_all(layer, keys, how)
        assert str(layer.path) in str(info.value)
    finally:
        os.close(other)


async def test_shutdown_waits_for_or_cleanly_fails_reads_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = StorageConfig(checkpoint_distance=1 << 30, validate_get=False, double_buffering=False)
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    tl = await tenant.create_timeline(TimelineId.generate())
    for i in range(8):
        await tl.put(k(i), Lsn(10 + i), Image(b"page%d" % i))
    tl.finish_write(Lsn(20))
    await tl.flush()
    admitted = trio.Event()
    go_on = trio.Event()
    real = read_path.get_vectored

    async def paused(*args: Any) -> None:
        admitted.set()  # past the timeline's checks, before the walk
        await go_on.wait()
        await real(*args)

    monkeypatch.setattr(read_path, "get_vectored", paused)
    result: list[object] = []

    async def read() -> None:
        try:
            result.append(await tl.get_vectored([k(i) for i in range(8)], Lsn(20)))
        except Exception as exc:
            result.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await admitted.wait()
        await tl.shutdown()
        go_on.set()
    # the pages, or a clear error of the shutdown: never "the key does not exist"
    assert len(result) == 1
    assert isinstance(result[0], dict) or not isinstance(result[0], (MissingKeyError, OSError)), result
    assert isinstance(result[0], TimelineShutdownError), result
    with pytest.raises(TimelineShutdownError):  # and a read that starts after it
        await tl.get_vectored([k(0)], Lsn(20))
    await tenant.shutdown()


# -- branch points, cached pages and mixed LSNs at the boundaries ----------------------------------


@pytest.mark.parametrize("seed", range(int(os.environ.get("R4_SEEDS", "4"))))
async def test_branch_point_cached_pages_and_mixed_lsns_at_boundaries(tmp_path: Path, seed: int) -> None:
    """Reads at exactly the branch LSN, one above it, at layer boundaries and inside delta
    layers' LSN ranges, with cached pages at those LSNs too; single keys, batches and mixed-LSN
    batches, against a model (``validate_get``: the legacy path must agree as well)."""
    rng = random.Random(seed)
    cfg = StorageConfig(
        checkpoint_distance=1 << 30, compaction_threshold=3, compaction_target_size=8192 * 2,
        image_creation_threshold=2, validate_get=True, double_buffering=False,
        page_cache_size=1 << 20, index_cache_blocks=4, max_vectored_read_bytes=128,
    )
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    main = await tenant.create_timeline(TimelineId.generate())
    n_keys = 10
    hist: dict[tuple[int, int], list[tuple[int, bytes]]] = {}  # (timeline, key) -> versions
    lsn = 0
    boundaries: list[int] = []

    async def write(tl_index: int, tl: Any, rounds: int, first_images: bool) -> None:
        nonlocal lsn
        for r in range(rounds):
            for i in rng.sample(range(n_keys), rng.randint(3, n_keys)):
                lsn += 1
                versions = hist.setdefault((tl_index, i), [])
                prev = _value(tl_index, i, lsn)
                if prev is None or (first_images and r == 0) or rng.random() < 0.15:
                    page = b"i%d.%d" % (i, lsn)
                    await tl.put(k(i), Lsn(lsn), Image(page))
                else:
                    await tl.put(k(i), Lsn(lsn), TestRecord.wal_append(f",{lsn}"))
                    page = prev + f",{lsn}".encode()
                versions.append((lsn, page))
            tl.finish_write(Lsn(lsn))
            if rng.random() < 0.7:
                await tl.flush()
                boundaries.append(lsn)
            if rng.random() < 0.3:
                await tl.compact(force_image=rng.random() < 0.3)

    def _value(tl_index: int, i: int, at: int) -> bytes | None:
        page = None
        if tl_index == 1:
            page = _value(0, i, min(at, branch_lsn))
        for x, p in hist.get((tl_index, i), []):
            if x <= at:
                page = p
        return page

    branch_lsn = 0
    await write(0, main, 6, True)
    branch_lsn = lsn
    child = await tenant.create_timeline(TimelineId.generate(), ancestor=main, ancestor_lsn=Lsn(branch_lsn))
    await write(0, main, 2, False)  # the ancestor moves on past the branch point
    await write(1, child, 5, False)
    timelines = [main, child]
    interesting = sorted(
        {1, branch_lsn - 1, branch_lsn, branch_lsn + 1, lsn}
        | {b + d for b in boundaries for d in (-1, 0, 1)}
        | {rng.randint(1, lsn) for _ in range(6)}
    )
    interesting = [x for x in interesting if 1 <= x <= lsn]
    for _ in range(40):
        t = rng.randrange(2)
        tl = timelines[t]
        at = rng.choice(interesting)
        keys = sorted(rng.sample(range(n_keys), rng.choice((1, 1, 3, n_keys))))
        kind = rng.randrange(3)
        if kind == 0:
            got = await tl.get_vectored_results([k(i) for i in keys], Lsn(at))
            for i in keys:
                want = _value(t, i, at)
                res = got[k(i)]
                assert (res == want) if want is not None else isinstance(res, MissingKeyError), (t, i, at, res, want)
        else:
            reqs = [(k(i), Lsn(rng.choice(interesting))) for i in keys]
            results = await tl.get_pages(reqs)
            for (key, x), res in zip(reqs, results, strict=True):
                i = keys[[k(j) for j in keys].index(key)]
                want = _value(t, i, x)
                assert (res == want) if want is not None else isinstance(res, MissingKeyError), (t, i, x, res, want)
    await tenant.shutdown()
