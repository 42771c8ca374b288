"""One test per rule of the page store (``compute.pagefs``): each fails if its rule is taken
out. The state machine (``test_pagefs_store_model``) mixes them; these name them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from compute.pagefs.cache_file import LocalPageFile
from compute.pagefs.names import FSM, INIT, MAIN, VM
from compute.pagefs.page_header import (
    BLCKSZ,
    BTREE_SPECIAL,
    PD_ALL_VISIBLE,
    ZERO_PAGE,
    btree_cycle_id,
    make_page,
)
from compute.pagefs.store import Keep, PageStore, ReadRetry, RelFile
from protocol.lsn import MAX_LSN, Lsn
from protocol.pagestream import RelTag

S = Lsn(0x0300_0000)


class Durable:
    lsn = S


@pytest.fixture
def durable() -> Durable:
    return Durable()


def _store(tmp_path: Path, durable: Durable, *, hints: bool = True, primary: bool = True,
           pages: int = 64) -> PageStore:
    return PageStore(LocalPageFile(tmp_path / "cache", pages), start_lsn=S, primary=primary,
                     durable_lsn=lambda: durable.lsn, wal_log_hints=hints)


@pytest.fixture
def store(tmp_path: Path, durable: Durable) -> Iterator[PageStore]:
    s = _store(tmp_path, durable)
    yield s
    s.cache.close()


def rel(fork: int = MAIN, relnode: int = 16384, db: int = 5) -> RelTag:
    return RelTag(1663, db, relnode, fork)


def _evicts(store: PageStore, f: RelFile, page: bytes, durable: Durable) -> bool:
    store.write_block(f, 0, page)
    durable.lsn = Lsn(0x0F00_0000)
    store.evict_all()
    return 0 not in f.local


def test_r1_unwritten_block_is_read_at_the_start_lsn(store: PageStore) -> None:
    f = store.new_file(rel(), 0, 10)
    plan = store.plan_read(f, 3 * BLCKSZ, 2 * BLCKSZ)
    assert [(r.blk, r.request_lsn, r.not_modified_since) for r in plan.remote] == [
        (3, MAX_LSN, S), (4, MAX_LSN, S)]
    # a kernel readahead of 128 KiB is one plan of 16 remote reads (one pagestream batch)
    assert len(store.plan_read(f, 0, 128 * 1024).remote) == 10  # clamped to the file size


def test_read_only_endpoint_reads_at_its_lsn(tmp_path: Path, durable: Durable) -> None:
    s = _store(tmp_path, durable, primary=False)
    f = s.new_file(rel(), 0, 4)
    assert {r.request_lsn for r in s.plan_read(f, 0, 4 * BLCKSZ).remote} == {S}
    # its WAL reaches no safekeeper: a page it wrote past S never leaves
    durable.lsn = Lsn(0x0F00_0000)
    s.write_block(f, 0, make_page(S + 0x100, fill=1))
    assert s.evict_all() == 0
    s.cache.close()


def test_r4_evicted_block_is_read_at_its_pd_lsn(store: PageStore, durable: Durable) -> None:
    f = store.new_file(rel(), 0, 4)
    lsn = Lsn(S + 0x1000)
    store.write_block(f, 1, make_page(lsn, fill=7))
    assert store.evict_all() == 0  # R3b: the safekeepers do not hold WAL up to pd_lsn yet
    durable.lsn = lsn
    assert store.evict_all() == 1
    (r,) = store.plan_read(f, BLCKSZ, BLCKSZ).remote
    assert r.not_modified_since == lsn
    # a page last changed before S is read at S, never older
    store.write_block(f, 2, make_page(S - 0x1000, fill=8))
    store.evict_all()
    (r,) = store.plan_read(f, 2 * BLCKSZ, BLCKSZ).remote
    assert r.not_modified_since == S


def test_r2_a_write_wins_over_a_remote_read_in_flight(store: PageStore) -> None:
    f = store.new_file(rel(), 0, 4)
    plan = store.plan_read(f, 0, 2 * BLCKSZ)
    new = make_page(S + 8, fill=9)
    store.write_block(f, 1, new)
    old = [make_page(S - 8, fill=1), make_page(S - 8, fill=2)]
    got = store.assemble(plan, old)
    assert got[:BLCKSZ] == old[0] and got[BLCKSZ:] == new
    store.truncate(f, BLCKSZ)
    with pytest.raises(ReadRetry):
        store.assemble(plan, old)


def test_r3a_pages_without_a_real_lsn_stay(store: PageStore, durable: Durable) -> None:
    for lsn in (0, 1, 1000):  # zero, GistBuildLSN, an unlogged fake LSN
        f = store.new_file(rel(), 0, 0)
        assert not _evicts(store, f, make_page(lsn, fill=3), durable)
    f = store.new_file(rel(), 0, 0)
    assert _evicts(store, f, make_page(S + 8, fill=3), durable)


def test_zero_pages_take_no_slot_and_read_as_zeros(store: PageStore) -> None:
    f = store.new_file(rel(), 0, 0)
    for blk in range(100):
        store.write_block(f, blk, ZERO_PAGE)
    assert store.bytes_cached == 0 and f.size == 100 * BLCKSZ
    plan = store.plan_read(f, 0, 100 * BLCKSZ)
    assert not plan.remote and store.assemble(plan, []) == bytes(100 * BLCKSZ)


def test_r5_fsm_pages_are_dropped(store: PageStore, durable: Durable) -> None:
    f = store.new_file(rel(FSM), 0, 2)
    assert _evicts(store, f, make_page(0, fill=4), durable)  # even with pd_lsn 0
    (r,) = store.plan_read(f, 0, BLCKSZ).remote
    assert r.not_modified_since == S


def test_h1_all_visible_heap_pages_stay_without_wal_log_hints(tmp_path: Path, durable: Durable) -> None:
    s = _store(tmp_path, durable, hints=False)
    page = make_page(S + 8, flags=PD_ALL_VISIBLE, fill=5)
    f = s.new_file(rel(), 0, 0)
    assert not _evicts(s, f, page, durable)
    assert s.kept[Keep.ALL_VISIBLE] == 1
    g = s.new_file(rel(relnode=20000), 0, 0)
    assert _evicts(s, g, make_page(S + 8, fill=5), durable)  # without the flag it may go
    s.cache.close()
    # with wal_log_hints = on (the endpoints' setting) the flag carries a WAL position
    s2 = _store(tmp_path, durable, hints=True)
    assert _evicts(s2, s2.new_file(rel(), 0, 0), page, durable)
    s2.cache.close()


def test_h2_written_vm_pages_stay(store: PageStore, durable: Durable) -> None:
    f = store.new_file(rel(VM), 0, 1)
    assert not _evicts(store, f, make_page(S + 8, fill=6), durable)
    assert store.kept[Keep.VM_PAGE] == 1


def test_h3_btree_pages_with_a_cycle_id_stay(store: PageStore, durable: Durable) -> None:
    page = make_page(S + 8, special=BTREE_SPECIAL, last_u16=3, fill=2)
    assert btree_cycle_id(page) == 3
    assert not _evicts(store, store.new_file(rel(), 0, 0), page, durable)
    # cycle id 0, and the page ids of hash/GiST/SP-GiST in the same place, do not keep it
    for last in (0, 0xFF80, 0xFF81):
        p = make_page(S + 8, special=BTREE_SPECIAL, last_u16=last, fill=2)
        assert _evicts(store, store.new_file(rel(), 0, 0), p, durable), hex(last)


def test_h4_pages_of_a_new_database_stay(store: PageStore, durable: Durable) -> None:
    # FILE_COPY copies carry the template's pd_lsn, which the pageserver cannot serve there
    f = store.new_file(rel(db=16500), 0, 0, keep=Keep.NEW_DATABASE)
    assert not _evicts(store, f, make_page(S - 0x100, fill=1), durable)
    assert store.kept[Keep.NEW_DATABASE] == 1


def test_unlogged_relations_and_init_forks_stay(store: PageStore, durable: Durable) -> None:
    main = store.new_file(rel(relnode=17000), 0, 0)
    store.write_block(main, 0, make_page(S + 8, fill=1))  # before its init fork exists
    init = store.new_file(rel(INIT, relnode=17000), 0, 0)
    assert not _evicts(store, init, make_page(S + 8, fill=2), durable)
    assert 0 in main.local  # the main fork of an unlogged relation stays too
    store.unlink(init)
    store.evict_all()
    assert 0 not in main.local


def test_r7_truncated_then_extended_blocks_are_zeros(store: PageStore) -> None:
    f = store.new_file(rel(), 0, 8)
    store.truncate(f, 2 * BLCKSZ)
    store.write_block(f, 5, make_page(S + 8, fill=1))
    plan = store.plan_read(f, 0, 6 * BLCKSZ)
    assert [r.blk for r in plan.remote] == [0, 1]
    got = store.assemble(plan, [ZERO_PAGE, ZERO_PAGE])
    assert got[2 * BLCKSZ : 5 * BLCKSZ] == bytes(3 * BLCKSZ)
    store.unlink(f)
    assert f.size == 0 and not f.local


def test_clock_evicts_within_the_bound_and_grows_only_when_all_is_kept(tmp_path: Path, durable: Durable) -> None:
    s = _store(tmp_path, durable, pages=4)
    durable.lsn = Lsn(0x0F00_0000)
    f = s.new_file(rel(), 0, 0)
    for blk in range(10):
        s.write_block(f, blk, make_page(S + 8 * (blk + 1), fill=blk + 1))
    assert s.cache.used <= 4 and s.metrics.evictions == 6 and s.metrics.over_capacity == 0
    v = s.new_file(rel(VM), 0, 0)
    for blk in range(6):
        s.write_block(v, blk, make_page(S + 8, fill=blk + 1))
    assert s.cache.used == 6 and s.metrics.over_capacity == 2  # kept pages are never dropped
    for blk in range(6):
        assert s.assemble(s.plan_read(v, blk * BLCKSZ, BLCKSZ), []) == make_page(S + 8, fill=blk + 1)
    s.cache.close()


def test_the_evicted_lsn_map_is_bounded(tmp_path: Path, durable: Durable) -> None:
    s = PageStore(LocalPageFile(tmp_path / "cache", 64), start_lsn=S, primary=True,
                  durable_lsn=lambda: durable.lsn, wal_log_hints=True, max_evicted_entries=2)
    durable.lsn = Lsn(0x0F00_0000)
    f = s.new_file(rel(), 0, 8)
    lsns = [S + 0x100 * (i + 1) for i in range(3)]
    for blk, lsn in enumerate(lsns):
        s.write_block(f, blk, make_page(lsn, fill=blk + 1))
    assert s.evict_all() == 3
    assert s.evicted_entries == 2 and len(f.evicted) == 2
    dropped = next(b for b in range(3) if b not in f.evicted)
    assert s.evicted_floor == lsns[dropped]
    # the dropped block, and blocks never written, are read at the floor: never older than L
    nms = {r.blk: r.not_modified_since for r in s.plan_read(f, 0, 8 * BLCKSZ).remote}
    assert nms[dropped] == lsns[dropped] and nms[7] == lsns[dropped]
    assert all(nms[b] == lsns[b] for b in f.evicted)
    s.cache.close()
