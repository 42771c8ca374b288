"""Relation directories across modifications: the stored directory is patched, not re-encoded
(``patch_rel_dir``), and the writer's caches (``rel_dirs``, ``rel_dir_codes``, ``rel_sizes``)
say what a fresh writer reading the stored values says.

- ``patch_rel_dir`` equals ``encode_rel_dir`` of the changed set, for any directory and any
  additions and removals (few: spliced; many: encoded afresh), and refuses a patch that does
  not fit the directory;
- a random sequence of modifications (fork creations, drops, extensions, database drops,
  several forks in one modification, cache invalidations) over two databases: after each, the
  stored directory value is ``encode_rel_dir`` of the model's forks, and every cached size is
  of a fork in the directory with the stored size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.pgdatadir import Datadir, DatadirWriter, RelTag, encode_rel_dir, patch_rel_dir
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import rel_dir_key
from pageserver.tenant import Tenant
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

_forks = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 3))
_small_forks = st.tuples(st.integers(1, 40), st.integers(0, 3))


@settings(max_examples=200, deadline=None)
@given(
    rels=st.sets(_forks, max_size=300),
    add=st.sets(_forks, max_size=80),
    drop_frac=st.floats(0, 1),
    seed=st.randoms(use_true_random=False),
)
def test_patch_is_the_fresh_encoding(rels: set[tuple[int, int]], add: set[tuple[int, int]], drop_frac: float, seed: object) -> None:
    import random

    assert isinstance(seed, random.Random)
    add -= rels
    removed = {r for r in sorted(rels) if seed.random() < drop_frac / 4}
    after = (rels | add) - removed
    assert patch_rel_dir(encode_rel_dir(rels), add, removed, after) == encode_rel_dir(after)


def test_a_patch_that_does_not_fit_is_refused() -> None:
    code = encode_rel_dir({(5, 0), (7, 1)})
    with pytest.raises(AssertionError):
        patch_rel_dir(code, set(), {(6, 0)}, {(5, 0), (7, 1)})
    with pytest.raises(AssertionError):
        patch_rel_dir(code, {(5, 0)}, set(), {(5, 0), (7, 1)})


_step: st.SearchStrategy[tuple[str, int, list[tuple[int, int]], int]] = st.one_of(
    st.tuples(st.just("create"), st.integers(0, 1), st.lists(_small_forks, min_size=1, max_size=4), st.integers(0, 5)),
    st.tuples(st.just("drop"), st.integers(0, 1), st.lists(_small_forks, min_size=1, max_size=4), st.just(0)),
    st.tuples(st.just("extend"), st.integers(0, 1), st.lists(_small_forks, min_size=1, max_size=2), st.integers(1, 9)),
    st.tuples(st.just("dropdb"), st.integers(0, 1), st.just([]), st.just(0)),
    st.tuples(st.just("invalidate"), st.just(0), st.just([]), st.just(0)),
)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(_step, min_size=1, max_size=40))
def test_stored_directories_and_cached_sizes_follow_the_modifications(tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, int, list[tuple[int, int]], int]]) -> None:
    root = tmp_path_factory.mktemp("reldir")
    trio.run(_run_steps, root, steps)


async def _run_steps(root: Path, steps: list[tuple[str, int, list[tuple[int, int]], int]]) -> None:
    dbs = [(1663, 5), (1663, 16384)]
    async with trio.open_nursery() as nursery:
        tenant = Tenant(root, TenantId.generate(), StorageConfig(compaction_period_s=0, gc_period_s=0), nursery=nursery)
        try:
            tl = await tenant.create_timeline(TimelineId.generate())
            w = DatadirWriter(tl)
            model: dict[tuple[int, int], dict[tuple[int, int], int]] = {db: {} for db in dbs}
            lsn = 0x1000
            mod = w.begin(Lsn(lsn))
            for db in dbs:
                await mod.put_dbdir_creation(*db)
            await mod.commit()
            for kind, dbi, forks, n in steps:
                db = dbs[dbi]
                if kind == "invalidate":
                    w.invalidate()
                    continue
                lsn += 0x100
                mod = w.begin(Lsn(lsn))
                if kind == "create":
                    for r, f in forks:
                        await mod.put_rel_creation((*db, r, f), n)
                        if (r, f) not in model[db] or n:  # (an existing fork keeps its size unless given one)
                            model[db][(r, f)] = n
                elif kind == "drop":
                    for r, f in forks:
                        await mod.put_rel_drop((*db, r, f))
                        model[db].pop((r, f), None)
                elif kind == "extend":
                    for r, f in forks:
                        if (r, f) in model[db]:
                            await mod.put_rel_extend((*db, r, f), n)
                            model[db][(r, f)] = n
                else:
                    await mod.drop_dbdir(*db)
                    model[db].clear()
                    await mod.put_dbdir_creation(*db)
                await mod.commit()
                reader = Datadir(tl)
                for d in dbs:
                    stored = await tl.get(rel_dir_key(*d), Lsn(lsn))
                    assert stored == encode_rel_dir(set(model[d])), (kind, d)
                    if d in w.rel_dir_codes:
                        assert w.rel_dir_codes[d] == stored
                for (spc, dbn, r, f), size in w.rel_sizes.items():
                    assert (r, f) in model[(spc, dbn)]
                    assert size == model[(spc, dbn)][(r, f)]
                for d in dbs:
                    for (r, f), size in model[d].items():
                        assert await reader.get_rel_size(RelTag(d[0], d[1], r, f), Lsn(lsn)) == size
        finally:
            await tenant.shutdown()
            nursery.cancel_scope.cancel()
