"""``Timeline.get_pages`` with keys at different LSNs: one vectored walk for the whole batch.

Random puts over many keys with freezes, flushes, compactions and image creation, then random
mixed-LSN batches: ``get_pages`` must equal the legacy per-key read of every (key, lsn), the old
one-walk-per-LSN grouping and a plain dict model (``validate_get`` is on too, so the timeline
also checks itself against the legacy path). The layer-visit counter shows one walk per batch:
never more visits than the per-LSN walks together, and no more than there are layers when every
requested LSN is above the persistent layers (the page service's case while WAL streams in).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pageserver.storage import read_path
from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import ReadContext
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.reconstruct import (
    KeyState,
    MissingKeyError,
    PageReconstructError,
    reconstruct_value,
)
from pageserver.storage.value import Image, TestRecord, Value
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

KEYS = [rel_block_key(1663, 5, 1000 + i // 8, 0, i % 8) for i in range(24)]

Result = bytes | PageReconstructError


def _config(page_cache_size: int) -> StorageConfig:
    return StorageConfig(
        checkpoint_distance=512,
        compaction_threshold=3,
        compaction_target_size=8192 * 3,
        image_creation_threshold=2,
        gc_horizon=10_000,
        pitr_interval_s=3600,
        validate_get=True,
        page_cache_size=page_cache_size,
        index_cache_blocks=4,
        write_buffer_size=256,
        double_buffering=False,
        max_vectored_read_bytes=96,
    )


def _model_value(ops: list[tuple[int, Key, Value]], key: Key, lsn: int) -> bytes | None:
    page: bytes | None = None
    for op_lsn, k, v in ops:
        if k != key or op_lsn > lsn:
            continue
        if isinstance(v, Image):
            page = v.data
        elif isinstance(v, TestRecord):
            base = b"" if v.clear or page is None else page
            page = base + v.append.encode()
    return page


async def _legacy_get(tl: Timeline, key: Key, lsn: Lsn) -> Result:
    state = KeyState()
    await read_path.get_legacy(tl, key, lsn, state)
    try:
        return reconstruct_value(key, lsn, state, tl.redo)[0]
    except PageReconstructError as exc:
        return exc


def _same(a: Result, b: Result) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    return type(a) is type(b)


def _layer_count(tl: Timeline) -> int:
    return len(list(tl.layer_map)) + len(tl.in_memory_layers())


async def _put_batch(
    tl: Timeline, ops: list[tuple[int, Key, Value]], writes: list[tuple[int, str, str]], step: int
) -> None:
    lsn = Lsn(tl.last_record_lsn + step)
    batch: dict[Key, Value] = {}
    for ki, kind, text in writes:
        key = KEYS[ki]
        exists = _model_value(ops, key, lsn) is not None or key in batch
        value: Value
        if kind == "img" or not exists:
            value = Image(f"{text}@{lsn}".encode()) if kind != "init" else TestRecord.wal_init(text)
        elif kind == "init":
            value = TestRecord.wal_init(text)
        else:
            value = TestRecord.wal_append(f",{text}")
        batch.setdefault(key, value)
    for key, value in batch.items():
        await tl.put(key, lsn, value)
    tl.finish_write(lsn)
    ops.extend((lsn, key, value) for key, value in batch.items())


WRITES = st.lists(
    st.tuples(st.integers(0, len(KEYS) - 1), st.sampled_from(["img", "append", "init"]), st.text("abc", min_size=1, max_size=5)),
    min_size=1,
    max_size=10,
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), WRITES, st.integers(1, 30)),
        st.tuples(st.sampled_from(["freeze", "flush", "compact", "images"]), st.just([]), st.just(0)),
    ),
    min_size=8,
    max_size=50,
)


async def _build(tenant: Tenant, ops_spec: list[tuple[str, list[tuple[int, str, str]], int]]) -> tuple[Timeline, list[tuple[int, Key, Value]]]:
    tid = TimelineId.generate()
    await tenant.create_timeline(tid)
    tl = tenant.timelines[tid]
    ops: list[tuple[int, Key, Value]] = []
    for kind, writes, step in ops_spec:
        if kind == "put":
            await _put_batch(tl, ops, writes, step)
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_spec=OPS, data=st.data())
def test_mixed_lsn_batches_equal_legacy_and_per_lsn(
    ops_spec: list[tuple[str, list[tuple[int, str, str]], int]], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory(prefix="pagestore-mixed-") as d:
        # no page cache here: the per-LSN walks and the mixed one then see the same layers,
        # so their visit counts compare (the cached case is tested below)
        tenant = Tenant(Path(d), TenantId.generate(), _config(0))

        async def go() -> None:
            tl, ops = await _build(tenant, ops_spec)
            hi = int(tl.last_record_lsn)
            lo = int(tl.ancestor_lsn)
            persistent_end = max((int(x.desc.lsn_end) for x in tl.layer_map), default=0)
            for _ in range(3):
                reqs = data.draw(
                    st.lists(
                        st.tuples(st.sampled_from(KEYS), st.integers(lo, hi)),
                        min_size=1,
                        max_size=16,
                        unique_by=lambda r: r[0],
                    ),
                    label="batch",
                )
                batch = [(k, Lsn(lsn)) for k, lsn in reqs]
                ctx = ReadContext(max_vectored_read_bytes=96)
                got = await tl.get_pages(batch, ctx)
                per_lsn = await tl.get_pages_per_lsn(batch)
                for (key, lsn), g, p in zip(batch, got, per_lsn, strict=True):
                    legacy = await _legacy_get(tl, key, lsn)
                    assert _same(g, legacy), (key.hex(), lsn, g, legacy)
                    assert _same(g, p), (key.hex(), lsn, g, p)
                    expected = _model_value(ops, key, lsn)
                    if expected is None:
                        assert isinstance(g, MissingKeyError), (key.hex(), lsn, g)
                    else:
                        assert g == expected, (key.hex(), lsn, g, expected)
                # one walk: never more layer visits than the walks per distinct LSN together
                per_lsn_visits = 0
                by_lsn: dict[Lsn, list[Key]] = {}
                for key, lsn in batch:
                    by_lsn.setdefault(lsn, []).append(key)
                for lsn, keys in by_lsn.items():
                    one = ReadContext(max_vectored_read_bytes=96)
                    await tl.get_vectored_results(keys, lsn, one)
                    per_lsn_visits += one.layers_visited
                assert ctx.layers_visited <= per_lsn_visits, (ctx.layers_visited, per_lsn_visits)
                event(f"layers={min(_layer_count(tl), 6)} lsns={min(len(by_lsn), 4)}")
                if all(lsn + 1 >= persistent_end for _, lsn in batch):
                    assert ctx.layers_visited <= _layer_count(tl), (ctx.layers_visited, _layer_count(tl))

        trio.run(go)
        trio.run(tenant.shutdown)


async def test_streaming_batch_is_one_walk(tmp_path: Path) -> None:
    """The page service's case: LSNs scattered over the WAL being ingested, above the layer
    files; one visit per layer for the whole batch, where the per-LSN walks visit each layer
    once per LSN."""
    tenant = Tenant(tmp_path, TenantId.generate(), _config(0))
    tid = TimelineId.generate()
    await tenant.create_timeline(tid)
    tl = tenant.timelines[tid]
    ops: list[tuple[int, Key, Value]] = []
    for round_ in range(3):  # three L0 layers
        await _put_batch(tl, ops, [(i, "img", f"r{round_}") for i in range(len(KEYS))], 5)
        await _put_batch(tl, ops, [(i, "append", f"a{round_}") for i in range(0, len(KEYS), 2)], 5)
        await tl.flush()
    await _put_batch(tl, ops, [(i, "append", "f") for i in range(len(KEYS))], 5)
    await tl.freeze()
    lsns: list[Lsn] = []
    for n in range(8):  # the open layer, read while being written
        await _put_batch(tl, ops, [(n * 3 % len(KEYS), "append", f"o{n}"), (n, "append", "p")], 3)
        lsns.append(tl.last_record_lsn)
    batch = [(key, lsns[i % len(lsns)]) for i, key in enumerate(KEYS)]
    ctx = ReadContext(max_vectored_read_bytes=96)
    got = await tl.get_pages(batch, ctx)
    per_lsn_visits = 0
    for lsn in lsns:
        one = ReadContext(max_vectored_read_bytes=96)
        await tl.get_vectored_results([k for k, x in batch if x == lsn], lsn, one)
        per_lsn_visits += one.layers_visited
    for (key, lsn), g in zip(batch, got, strict=True):
        assert g == _model_value(ops, key, lsn)
    layers = _layer_count(tl)
    assert layers == 5  # 3 L0 + frozen + open
    assert ctx.layers_visited <= layers
    assert per_lsn_visits >= len(lsns) * ctx.layers_visited // 2
    await tenant.shutdown()


async def test_page_cache_and_repeated_key(tmp_path: Path) -> None:
    """With the page cache seeding keys at their own LSNs, and the same key at two LSNs in one
    call (split into rounds): still the legacy answers."""
    tenant = Tenant(tmp_path, TenantId.generate(), _config(1 << 20))
    tid = TimelineId.generate()
    await tenant.create_timeline(tid)
    tl = tenant.timelines[tid]
    ops: list[tuple[int, Key, Value]] = []
    lsns: list[Lsn] = []
    for n in range(12):
        await _put_batch(tl, ops, [(i, "append" if n else "img", f"{n}") for i in range(n % 3, len(KEYS), 3)], 4)
        lsns.append(tl.last_record_lsn)
        if n % 4 == 3:
            await tl.flush()
    batch = [(key, lsns[(i * 5) % len(lsns)]) for i, key in enumerate(KEYS)]
    batch += [(KEYS[0], lsns[-1]), (KEYS[0], lsns[2]), (KEYS[1], lsns[0])]
    for _ in range(2):  # the second time most keys start from cached pages
        got = await tl.get_pages(batch)
        for (key, lsn), g in zip(batch, got, strict=True):
            assert _same(g, await _legacy_get(tl, key, lsn)), (key.hex(), lsn)
            expected = _model_value(ops, key, lsn)
            assert g == expected if expected is not None else isinstance(g, MissingKeyError)
    # a batch at later LSNs than the cached pages: cache seeds below the request LSN
    later = [(key, Lsn(lsn + 4)) for key, lsn in batch[: len(KEYS)] if lsn + 4 <= lsns[-1]]
    got = await tl.get_pages(later)
    for (key, lsn), g in zip(later, got, strict=True):
        assert _same(g, await _legacy_get(tl, key, lsn))
    assert tl.page_cache.hits > 0
    await tenant.shutdown()


async def test_mixed_lsn_over_a_branch(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), _config(0))
    pid = TimelineId.generate()
    await tenant.create_timeline(pid)
    parent = tenant.timelines[pid]
    pops: list[tuple[int, Key, Value]] = []
    for n in range(6):
        await _put_batch(parent, pops, [(i, "append" if n else "img", f"p{n}") for i in range(len(KEYS))], 3)
    await parent.flush()
    branch_lsn = parent.last_record_lsn
    await _put_batch(parent, pops, [(i, "img", "after") for i in range(len(KEYS))], 3)
    cid = TimelineId.generate()
    await tenant.create_timeline(cid, ancestor=parent, ancestor_lsn=branch_lsn)
    child = tenant.timelines[cid]
    cops = [op for op in pops if op[0] <= branch_lsn]
    lsns = [branch_lsn]
    for n in range(5):
        await _put_batch(child, cops, [(i, "append", f"c{n}") for i in range(n, len(KEYS), 5)], 2)
        lsns.append(child.last_record_lsn)
        if n == 2:
            await child.flush()
    batch = [(key, lsns[i % len(lsns)]) for i, key in enumerate(KEYS)]
    got = await child.get_pages(batch)
    assert got == await child.get_pages_per_lsn(batch)
    for (key, lsn), g in zip(batch, got, strict=True):
        assert g == _model_value(cops, key, lsn)
    await tenant.shutdown()
