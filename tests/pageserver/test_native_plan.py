"""A vectored read's planning in one layer (kernel 3): compiled (pageserver/storage/_plan_c.pyx)
against the pure-Python twin (_plan_py.py), and both against the layer's awaiting path.

Both search the cached index blocks for runs of consecutive keys and plan each key's blobs
newest first. On the same index, keys, key states, bounds and block cache they must give the
same result (or the same error), leave the same blobs, reads, key states and LRU order, and on
hostile indexes (unsorted entries, offsets outside the data section, raw entries that are not
what the block decodes to, LSNs and bounds at the ends of u64, fences past the block count)
fail alike. The layer-level test checks, on a real layer file, that a walk which must read
index blocks first (``plan_reads`` over ``load_blocks``, with an empty cache or one too small to
hold a read's blocks) plans what the hot walk (``try_plan`` over the block cache) plans.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.storage import _plan_py, delta_layer
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.layer_file import _BLOCK_HDR, ENTRY, IndexBlock
from pageserver.storage.reconstruct import KeyState
from tests.conftest import kernel

PLAN = "pageserver.storage._plan_c"
U64 = (1 << 64) - 1
READER = "the-reader"
FILE_ID = 7


def _key(blk: int) -> Key:
    return rel_block_key(1663, 5, 16384, 0, blk)


def _block(entries: Sequence[tuple[bytes, int, int, int, int]]) -> IndexBlock:
    """An IndexBlock of (key, lsn, pos, length, crc) entries, in the given order."""
    raw = _BLOCK_HDR.pack(0, len(entries), 0) + b"".join(
        ENTRY.pack(k + lsn.to_bytes(8, "big"), pos, length, crc) for k, lsn, pos, length, crc in entries
    )
    return IndexBlock(raw, len(entries))


def _index(entries: Sequence[tuple[bytes, int, int, int, int]], sizes: list[int]) -> tuple[list[bytes], list[IndexBlock]]:
    blocks: list[IndexBlock] = []
    at = 0
    for size in sizes:
        if at >= len(entries):
            break
        blocks.append(_block(entries[at : at + size]))
        at += size
    if at < len(entries):
        blocks.append(_block(entries[at:]))
    if not blocks:
        blocks.append(_block([]))
    fences = [b.prefixes[0] if b.prefixes else bytes(26) for b in blocks]
    return fences, blocks


def _outcome(mod: ModuleType, case: dict[str, Any]) -> tuple[Any, ...]:
    c = copy.deepcopy(case)
    states: dict[bytes, KeyState] = c["states"]
    blobs: list[tuple[int, int, int]] = c["blobs"]
    reads: list[tuple[Any, int, int, int, int]] = []
    try:
        got = mod.plan_cached(
            c["fences"], c["n_blocks"], c["cache"], FILE_ID, c["keys"], c["floor"], c["cont"],
            states, blobs, reads, READER, c["max_bytes"], c["data_start"], c["data_end"],
        )
    except Exception as exc:
        return ("err", type(exc).__name__, exc.args if type(exc).__name__ == "EntryOutsideData" else ())
    after = {k: (st.complete, st.pending) for k, st in sorted(states.items())}
    return ("ok", got, blobs, reads, after, list(c["cache"]))


def _case(draw: st.DrawFn, hostile: bool) -> dict[str, Any]:
    n_keys = draw(st.integers(1, 24))
    lsns = sorted(draw(st.sets(st.integers(1, 60), min_size=1, max_size=6)))
    entries = []
    off = 4096
    for blk in range(n_keys):
        if draw(st.integers(0, 4)) == 0:
            continue  # a key the layer does not hold
        for lsn in sorted(draw(st.sets(st.sampled_from(lsns), min_size=1, max_size=4))):
            length = draw(st.integers(1, 40))
            gap = draw(st.sampled_from([0, 0, 0, 3]))
            off += gap
            entries.append((_key(blk), lsn, (off << 1) | draw(st.integers(0, 1)), length, draw(st.integers(0, 2**32 - 1))))
            off += length
    if hostile and entries and draw(st.booleans()):
        random.Random(draw(st.integers(0, 1000))).shuffle(entries)  # an unsorted index
    if hostile and entries and draw(st.booleans()):
        i = draw(st.integers(0, len(entries) - 1))
        k, lsn, _pos, length, crc = entries[i]
        entries[i] = (k, draw(st.sampled_from([0, U64, 1 << 63])), draw(st.sampled_from([0, U64, 2, U64 - 1])), length, crc)
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=12))
    fences, blocks = _index(entries, sizes)
    cache: OrderedDict[tuple[int, int], IndexBlock] = OrderedDict()
    for b, block in enumerate(blocks):
        if not (hostile and draw(st.integers(0, 9)) == 0):  # sometimes a block is not cached
            cache[(FILE_ID, b)] = block
    if hostile and draw(st.integers(0, 9)) == 0 and cache:
        first = next(iter(cache))
        cache[first].raw = cache[first].raw[:-1]  # raw entries that are not what it decodes to
    want = sorted(draw(st.sets(st.integers(0, n_keys + 2), min_size=1, max_size=n_keys + 3)))
    keys = [_key(b) for b in want]
    if hostile and draw(st.integers(0, 9)) == 0:
        keys = list(reversed(keys))
    states: dict[bytes, KeyState] = {}
    for k in keys:
        s = KeyState(draw(st.sampled_from([-1, -1, *lsns])), None)
        s.pending = None if hostile and draw(st.integers(0, 19)) == 0 else []
        s.complete = draw(st.integers(0, 9)) == 0
        states[k] = s
    bound = st.sampled_from([0, 1, *lsns, 61, U64, U64 + 1, -1]) if hostile else st.sampled_from([0, *lsns, 61])
    return {
        "fences": fences,
        "n_blocks": len(blocks) + (1 if hostile and draw(st.integers(0, 9)) == 0 else 0),
        "cache": cache,
        "keys": keys,
        "floor": draw(bound),
        "cont": draw(bound) if hostile else draw(st.sampled_from([*lsns, 61, U64 + 1])),
        "states": states,
        "blobs": [(0, 0, 0)] * draw(st.integers(0, 3)),
        "max_bytes": draw(st.sampled_from([0, 10, 64, 1 << 20] + ([-1, 1 << 70] if hostile else []))),
        "data_start": 4096 if not hostile else draw(st.sampled_from([4096, 4200, -1])),
        "data_end": off if not hostile else draw(st.sampled_from([off, off - 5, U64 + 5, -1])),
    }


@st.composite
def _cases(draw: st.DrawFn, hostile: bool) -> dict[str, Any]:
    return _case(draw, hostile)


@pytest.mark.native
@settings(max_examples=150, deadline=None)
@given(_cases(hostile=False))
def test_native_plans_as_the_twin(case: dict[str, Any]) -> None:
    native = kernel("native", PLAN)
    assert _outcome(native, case) == _outcome(_plan_py, case)


@pytest.mark.native
@settings(max_examples=150, deadline=None)
@given(_cases(hostile=True))
def test_native_fails_as_the_twin_on_hostile_indexes(case: dict[str, Any]) -> None:
    native = kernel("native", PLAN)
    assert _outcome(native, case) == _outcome(_plan_py, case)


def _deferring() -> KeyState:
    s = KeyState()
    s.pending = []
    return s


def _simple(impl: str, **over: Any) -> tuple[Any, ...]:
    entries = [(_key(b), lsn, ((4096 + 100 * (2 * b + i)) << 1) | (i == 0), 100, b) for b in range(10)
               for i, lsn in enumerate((10, 20))]
    fences, blocks = _index(entries, [7, 7])
    cache = OrderedDict(((FILE_ID, b), block) for b, block in enumerate(blocks))
    keys = [_key(b) for b in (1, 2, 3, 7)]
    states = {k: KeyState() for k in keys}
    for s in states.values():
        s.pending = []
    case = {"fences": fences, "n_blocks": len(blocks), "cache": cache, "keys": keys, "floor": 0,
            "cont": 100, "states": states, "blobs": [], "max_bytes": 1 << 20, "data_start": 4096,
            "data_end": 4096 + 100 * 20, **over}
    return _outcome(kernel(impl, PLAN), case)


def test_a_run_of_keys_is_planned_newest_first_in_adjacent_reads(impl: str) -> None:
    outcome = _simple(impl)
    assert outcome[0] == "ok"
    _, got, blobs, reads, after, _lru = outcome
    # blocks hit: keys 1-3 cross from block 0 into 1; key 7 starts at block 1 (its fence is
    # key 7 at LSN 10, above key 7 + LSN 0) and goes on into 2. Keys completed: 4.
    assert got == (4, 4)
    # key 7, then 3, 2, 1; each key's two entries newest first: 8 blobs
    assert [b[0] for b in blobs] == [4096 + 100 * i for i in (15, 14, 7, 6, 5, 4, 3, 2)]
    # keys 1-3 are adjacent in the file: one read; key 7 its own
    assert [(r[1], r[2], r[3], r[4]) for r in reads] == [(4096 + 1400, 200, 0, 2), (4096 + 200, 600, 2, 6)]
    assert all(r[0] == READER for r in reads)
    assert after[_key(7)] == (True, [(20, 0), (10, 1)])


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"data_end": 4096 + 100 * 10}, "EntryOutsideData"),
        ({"data_start": 5000}, "EntryOutsideData"),
        ({"keys": [b"short"]}, "ValueError"),
        ({"fences": [1, 2]}, "TypeError"),
        ({"n_blocks": 9, "keys": [_key(9)], "states": {_key(9): _deferring()}}, "IndexError"),
    ],
)
def test_hostile_inputs_fail_with_a_clear_error(impl: str, over: dict[str, Any], error: str) -> None:
    outcome = _simple(impl, **over)
    assert outcome[:2] == ("err", error)


def test_a_block_missing_from_the_cache_plans_nothing(impl: str) -> None:
    entries = [(_key(b), 10, (4096 + 100 * b) << 1 | 1, 100, 0) for b in range(20)]
    fences, blocks = _index(entries, [5, 5, 5, 5])
    cache = OrderedDict(((FILE_ID, b), block) for b, block in enumerate(blocks) if b != 2)
    keys = [_key(1), _key(12)]
    states = {k: KeyState() for k in keys}
    for s in states.values():
        s.pending = []
    blobs: list[tuple[int, int, int]] = []
    reads: list[Any] = []
    got = kernel(impl, PLAN).plan_cached(fences, len(blocks), cache, FILE_ID, keys, 0, 100, states,
                                         blobs, reads, READER, 1 << 20, 4096, 4096 + 2000)
    assert got is None and blobs == [] and reads == []
    assert all(s.pending == [] and not s.complete for s in states.values())


async def test_a_cold_index_plans_what_the_cached_index_plans(impl: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real delta layer, ``plan_reads`` with the index blocks not cached (a fresh cache, or
    one that holds no block at all) plans the same blobs, reads and key states as ``try_plan``
    over a warm cache: one planner, whatever the cache holds."""
    from pageserver.storage.delta_layer import PersistentLayer, ReadContext, write_delta_layer
    from pageserver.storage.io_engine import make_io_engine
    from pageserver.storage.key import KeyRange, key_next
    from pageserver.storage.layer_file import IndexBlockCache
    from pageserver.storage.value import Image, PostgresRecord, encode_value
    from protocol.lsn import Lsn

    monkeypatch.setattr(delta_layer, "_plan_cached", kernel(impl, PLAN).plan_cached)
    rng = random.Random(5)
    entries = []
    for blk in range(600):
        for lsn in sorted(rng.sample(range(16, 400, 8), rng.randint(1, 4))):
            value: Image | PostgresRecord = (
                Image(bytes([blk % 256]) * 64) if rng.random() < 0.3
                else PostgresRecord(rng.random() < 0.2, b"r" * rng.randint(1, 30))
            )
            entries.append((_key(blk), Lsn(lsn), encode_value(value), value.will_init))
    engine = make_io_engine("blocking")

    async def feed() -> AsyncIterator[tuple[Key, Lsn, bytes, bool]]:
        for entry in entries:
            yield entry

    path = await write_delta_layer(engine, tmp_path, KeyRange(_key(0), key_next(_key(599))), Lsn(16), Lsn(401), feed())
    assert path is not None
    warm = await PersistentLayer.open(engine, path, IndexBlockCache(1000))
    none = await PersistentLayer.open(engine, path, IndexBlockCache(0))
    assert warm.reader.summary.n_index_blocks > 3  # runs of keys cross index blocks
    try:
        for trial in range(30):
            keys = sorted(_key(b) for b in rng.sample(range(650), rng.randint(1, 40)))
            if trial % 5 == 4:
                keys = [_key(b) for b in range(100, 100 + rng.randint(80, 300))]  # one long run
            floor, cont = sorted(rng.sample(range(420), 2))
            cached = {k: rng.choice([-1, 100, 200]) if trial % 3 == 0 else -1 for k in keys}
            max_bytes = rng.choice([64, 4096, 1 << 17])
            outs = []
            for how in ("cold", "no cache", "warm"):
                layer = warm if how != "no cache" else none
                if how == "cold":
                    warm.reader.cache.clear()
                states = {k: KeyState(cached[k], None) for k in keys}
                for s in states.values():
                    s.pending = []
                ctx = ReadContext(max_vectored_read_bytes=max_bytes, any_cached=trial % 3 == 0)
                if how == "warm":
                    got = layer.try_plan(keys, floor, cont, states, ctx)
                    assert got is not None  # the cold pass cached every block it read
                    left = got
                else:
                    assert layer.try_plan(keys, floor, cont, states, ctx) is None
                    left = await layer.plan_reads(keys, floor, cont, states, ctx)
                outs.append((list(left), ctx.blobs, [r[1:] for r in ctx.reads], ctx.layers_visited,
                             {k: (s.complete, s.pending) for k, s in states.items()}))
            assert outs[0] == outs[1] == outs[2]
            assert len(none.reader.cache._blocks) == 0
    finally:
        await warm.aclose()
        await none.aclose()


@pytest.mark.native
def test_same_names_and_signatures() -> None:
    import inspect

    native = kernel("native", PLAN)
    assert native.__all__ == _plan_py.__all__
    assert native.ENTRY_SIZE == _plan_py.ENTRY_SIZE == ENTRY.size

    def params(fn: object) -> list[str]:
        return [p.name for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]

    assert params(native.plan_cached) == params(_plan_py.plan_cached)


def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from bench import fuzz

    seeds = tmp_path / "corpus"
    seeds.mkdir()
    fuzz.write_seeds("plan-cached", seeds)
    same = fuzz._harness("plan-cached", _plan_py, _plan_py)

    def lying(*args: Any) -> object:
        got = _plan_py.plan_cached(*args)
        return None if got is None else (got[0], got[1] + 1)

    broken = fuzz._harness("plan-cached", SimpleNamespace(plan_cached=lying), _plan_py)  # type: ignore[arg-type]
    found = 0
    for seed in sorted(seeds.iterdir()):
        data = seed.read_bytes()
        same(data)
        outcome = fuzz.plan_outcome(_plan_py, data)
        assert outcome is not None
        result = outcome[0]
        assert isinstance(result, tuple)
        if result[0] == "ok":
            found += 1
            with pytest.raises(AssertionError, match="differs"):
                broken(data)
    assert found  # the seeds plan something
