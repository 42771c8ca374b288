"""The page store against a dict model (hypothesis state machine): writes (logged, hint-only,
without a real LSN, zero extensions), truncations, unlinks, evictions, durability advancing and
restarts of the page filesystem, over a fake pageserver that holds only what the WAL says. Every
read returns what the model allows, and every GetPage the store sends carries the
``not_modified_since`` the rules prescribe (``compute.pagefs`` R1-R7, H1-H3)."""

from __future__ import annotations

from pathlib import Path

import attrs
import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from compute.pagefs.cache_file import LocalPageFile
from compute.pagefs.names import FSM, INIT, MAIN, VM
from compute.pagefs.page_header import (
    BLCKSZ,
    BTREE_SPECIAL,
    PD_ALL_VISIBLE,
    ZERO_PAGE,
    make_page,
    page_lsn,
)
from compute.pagefs.store import PageStore, RelFile, RemoteRead
from protocol.lsn import MAX_LSN, Lsn
from protocol.pagestream import RelTag

S0 = 0x0200_0000
A = 16384  # a permanent relation: main, fsm, vm
U = 16390  # an unlogged relation: init and main
FILES = {"a": (A, MAIN), "a_fsm": (A, FSM), "a_vm": (A, VM), "u": (U, MAIN)}
MAX_BLK = 6


def rel(relnode: int, fork: int) -> RelTag:
    return RelTag(1663, 5, relnode, fork)


def model_keeps(name: str, page: bytes) -> bool:
    """The rules, written out independently of the store: may this written page never leave?"""
    if name == "a_fsm":
        return False  # R5
    if name in ("a_vm", "u"):
        return True  # H2; unlogged
    if int.from_bytes(page[:4], "little") == 0 and int.from_bytes(page[4:8], "little") < 0x0100_0000:
        return True  # R3a
    special = int.from_bytes(page[16:18], "little")
    cycle = int.from_bytes(page[-2:], "little")
    return special == BTREE_SPECIAL and 0 < cycle <= 0xFF7F  # H3


@attrs.define
class Block:
    written: bytes | None = None  # what this compute last wrote since S (None: nothing)
    kept: bool = False  # the model's verdict: that write may never leave the cache
    hinted: bool = False  # the last write changed hints only (not in WAL)


class PageStoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(f"/tmp/pagefs-model-{id(self)}.cache")
        self.wal_end = S0
        self.durable = S0
        # the fake pageserver: (relnode, fork, blk) -> [(lsn, page)], and relation sizes by LSN
        self.versions: dict[tuple[int, int, int], list[tuple[int, bytes]]] = {}
        self.ps_size: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.counter = 0
        self.fetches = 0

    # -- the fake pageserver ----------------------------------------------------------------

    def ps_log_page(self, relnode: int, fork: int, blk: int, lsn: int, page: bytes) -> None:
        self.versions.setdefault((relnode, fork, blk), []).append((lsn, page))
        size = self.ps_nblocks(relnode, fork, lsn)
        if blk >= size:
            self.ps_size.setdefault((relnode, fork), []).append((lsn, blk + 1))

    def ps_nblocks(self, relnode: int, fork: int, lsn: int) -> int:
        sizes = [n for at, n in self.ps_size.get((relnode, fork), []) if at <= lsn]
        return sizes[-1] if sizes else 0

    def ps_page(self, relnode: int, fork: int, blk: int, lsn: int) -> tuple[int, bytes]:
        if blk >= self.ps_nblocks(relnode, fork, lsn):
            return 0, ZERO_PAGE
        cut = max((at for at, n in self.ps_size.get((relnode, fork), []) if at <= lsn and n <= blk),
                  default=-1)  # the newest truncation below the block
        got = [(at, p) for at, p in self.versions.get((relnode, fork, blk), []) if cut < at <= lsn]
        return got[-1] if got else (0, ZERO_PAGE)

    def fetch(self, f: RelFile, reads: list[RemoteRead]) -> list[bytes]:
        out = []
        for r in reads:
            self.fetches += 1
            assert r.request_lsn == MAX_LSN  # a primary reads the latest version
            assert r.not_modified_since <= self.durable, "the pageserver would wait for WAL it never gets"
            blk = self.model[self.name_of(f)].get(r.blk, Block())
            key = self.name_of(f)
            assert not blk.kept, f"{key} block {r.blk} was kept local, yet read remotely"
            if blk.written is None:
                assert r.not_modified_since == self.store.start_lsn, "R1: never written -> S"
            elif f.rel.forknum != FSM:
                want = max(page_lsn(blk.written), self.store.start_lsn)
                assert r.not_modified_since == want, "R4: evicted -> max(pd_lsn, S)"
            out.append(self.ps_page(f.rel.relnode, f.rel.forknum, r.blk, self.durable)[1])
        return out

    # -- the page store -----------------------------------------------------------------------

    def start_store(self) -> None:
        cache = LocalPageFile(self.tmp, 3)
        self.store = PageStore(cache, start_lsn=Lsn(self.durable), primary=True,
                               durable_lsn=lambda: Lsn(self.durable), wal_log_hints=True)
        self.files: dict[str, RelFile] = {}
        self.model: dict[str, dict[int, Block]] = {}
        self.zero_from: dict[str, int] = {}  # blocks at or past this read as zeros unless written
        init = self.store.new_file(rel(U, INIT), 0, 0)
        self.store.write_block(init, 0, self.init_page)
        for name, (relnode, fork) in FILES.items():
            n = self.ps_nblocks(relnode, fork, self.durable) if relnode == A else 0
            self.files[name] = self.store.new_file(rel(relnode, fork), 0, n)
            self.model[name] = {}
            self.zero_from[name] = n
        # an unlogged relation starts as a copy of its init fork
        self.store.write_block(self.files["u"], 0, self.init_page)
        self.model["u"][0] = Block(self.init_page, True)

    def name_of(self, f: RelFile) -> str:
        return next(n for n, g in self.files.items() if g is f)

    def read(self, name: str, blk: int) -> bytes:
        f = self.files[name]
        plan = self.store.plan_read(f, blk * BLCKSZ, BLCKSZ)
        return self.store.assemble(plan, self.fetch(f, plan.remote))

    def nblocks(self, name: str) -> int:
        return self.files[name].size // BLCKSZ

    @initialize()
    def setup(self) -> None:
        self.init_page = make_page(0, fill=0x11)
        lsn = self.next_lsn()
        for blk in range(3):  # the data at S: three pages of A's main fork
            self.ps_log_page(A, MAIN, blk, lsn, make_page(lsn, fill=0x20 + blk))
        self.durable = self.wal_end
        self.start_store()

    def next_lsn(self) -> int:
        self.wal_end += 0x100
        return self.wal_end

    def teardown(self) -> None:
        self.store.cache.close()

    # -- rules --------------------------------------------------------------------------------

    names = st.sampled_from(sorted(FILES))

    @rule(name=names, data=st.data(), kind=st.sampled_from(["plain", "btree", "all_visible"]))
    def write_logged(self, name: str, data: st.DataObject, kind: str) -> None:
        """A change with a WAL record: PostgreSQL flushed the WAL up to pd_lsn first."""
        blk = data.draw(st.integers(0, min(self.nblocks(name), MAX_BLK)))
        relnode, fork = FILES[name]
        lsn = self.next_lsn()
        self.counter += 1
        fill = self.counter % 200 + 30
        if kind == "btree":
            page = make_page(lsn, special=BTREE_SPECIAL, last_u16=data.draw(st.sampled_from([0, 7])), fill=fill)
        elif kind == "all_visible":
            page = make_page(lsn, flags=PD_ALL_VISIBLE, fill=fill)
        else:
            page = make_page(lsn, fill=fill)
        self.store.write_block(self.files[name], blk, page)
        kept = model_keeps(name, page)
        if name not in ("u", "a_fsm"):  # unlogged relations and FSM pages have no WAL
            self.ps_log_page(relnode, fork, blk, lsn, page)
        self.model[name][blk] = Block(page, kept)

    @rule(name=names, data=st.data())
    def write_hint(self, name: str, data: st.DataObject) -> None:
        """A hint-bit change: same pd_lsn, not in WAL."""
        if self.nblocks(name) == 0:
            return
        blk = data.draw(st.integers(0, self.nblocks(name) - 1))
        cur = bytearray(self.read(name, blk))
        if cur == ZERO_PAGE:
            return
        cur[100] ^= 0xFF
        page = bytes(cur)
        self.store.write_block(self.files[name], blk, page)
        self.model[name][blk] = Block(page, model_keeps(name, page), hinted=True)

    @rule(name=st.sampled_from(["a", "u"]), data=st.data(), lsn=st.sampled_from([0, 1, 1000]))
    def write_unreal_lsn(self, name: str, data: st.DataObject, lsn: int) -> None:
        """A page written without WAL (a GiST/GIN build, an unlogged relation)."""
        blk = data.draw(st.integers(0, min(self.nblocks(name), MAX_BLK)))
        self.counter += 1
        page = make_page(lsn, fill=self.counter % 200 + 30)
        self.store.write_block(self.files[name], blk, page)
        self.model[name][blk] = Block(page, model_keeps(name, page))

    @rule(name=names)
    def zero_extend(self, name: str) -> None:
        """mdextend: a zero page at the end, no WAL."""
        blk = self.nblocks(name)
        if blk > MAX_BLK:
            return
        self.store.write_block(self.files[name], blk, ZERO_PAGE)
        self.model[name][blk] = Block(ZERO_PAGE, True)

    @rule(name=st.sampled_from(["a", "a_fsm", "a_vm"]), data=st.data())
    def truncate(self, name: str, data: st.DataObject) -> None:
        """XLOG_SMGR_TRUNCATE, then ftruncate."""
        n = data.draw(st.integers(0, self.nblocks(name)))
        relnode, fork = FILES[name]
        lsn = self.next_lsn()
        if self.ps_nblocks(relnode, fork, lsn) > n:
            self.ps_size.setdefault((relnode, fork), []).append((lsn, n))
        self.store.truncate(self.files[name], n * BLCKSZ)
        for blk in [b for b in self.model[name] if b >= n]:
            del self.model[name][blk]
        self.zero_from[name] = min(self.zero_from[name], n)

    @rule()
    def unlink_and_reuse(self) -> None:
        """DROP TABLE (the commit drops the relation on the pageserver), then the relfilenode
        is used again by a new relation."""
        lsn = self.next_lsn()
        for fork in (MAIN, FSM, VM):
            self.ps_size.setdefault((A, fork), []).append((lsn, 0))
        for name in ("a", "a_fsm", "a_vm"):
            relnode, fork = FILES[name]
            self.store.unlink(self.files[name])
            self.files[name] = self.store.new_file(rel(relnode, fork), 0, 0)
            self.model[name] = {}
            self.zero_from[name] = 0

    @rule()
    def safekeepers_catch_up(self) -> None:
        self.durable = self.wal_end

    @rule()
    def evict_everything_allowed(self) -> None:
        self.store.evict_all()

    @rule()
    def restart(self) -> None:
        """kill -9 of PostgreSQL and the page filesystem: WAL past D is lost (never
        acknowledged), the cache is gone, a new endpoint starts at S = D."""
        for key in list(self.versions):
            self.versions[key] = [(at, p) for at, p in self.versions[key] if at <= self.durable]
        for rkey in list(self.ps_size):
            self.ps_size[rkey] = [(at, n) for at, n in self.ps_size[rkey] if at <= self.durable]
        self.wal_end = self.durable
        self.store.cache.close()
        self.start_store()

    @rule(name=names, data=st.data())
    def read_block(self, name: str, data: st.DataObject) -> None:
        if self.nblocks(name) == 0:
            return
        blk = data.draw(st.integers(0, self.nblocks(name) - 1))
        got = self.read(name, blk)
        relnode, fork = FILES[name]
        b = self.model[name].get(blk)
        if b is not None and b.written is not None:
            if b.kept:
                assert got == b.written, f"{name} block {blk}: a kept page changed"
            elif fork == FSM:
                pass  # hints: anything the pageserver has
            else:
                # the written page, or (evicted) the logged version it carries the LSN of
                at, logged = self.ps_page(relnode, fork, blk, self.durable)
                assert got == b.written or (at == page_lsn(b.written) and logged == got), (
                    f"{name} block {blk}: neither the written page nor its WAL version")
        elif blk >= self.zero_from[name]:
            assert got == ZERO_PAGE, f"{name} block {blk}: past the truncation or start size, not zeros"
        else:
            assert got == self.ps_page(relnode, fork, blk, self.store.start_lsn)[1]

    @precondition(lambda self: hasattr(self, "store"))
    @invariant()
    def kept_pages_stay(self) -> None:
        for name, blocks in self.model.items():
            f = self.files[name]
            for blk, b in blocks.items():
                if b.kept and b.written is not None and b.written != ZERO_PAGE:
                    assert blk in f.local, f"{name} block {blk} was evicted though kept"


PageStoreModel.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestPageStoreModel = PageStoreModel.TestCase
