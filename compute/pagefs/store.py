"""The page store: the relation segment files of a lazy endpoint, what each block is (written
and held in the local page file, known to be zeros, evicted at an LSN, or still the
pageserver's at the start LSN), and the GetPage LSNs a read needs. No FUSE and no IO but the
local page file: the filesystem (``compute.pagefs.fs``) turns kernel requests into calls here,
and the remote reads a plan asks for into pagestream batches (``compute.pagefs.remote``).

The rules it enforces are in the package docstring (``compute.pagefs``); the names of the
rules (R1..R7, H1..H4) are those of ``docs/compute.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Final

import attrs

from compute.pagefs.cache_file import LocalPageFile
from compute.pagefs.names import FSM, INIT, VM
from compute.pagefs.page_header import (
    BLCKSZ,
    ZERO_PAGE,
    all_visible_flag,
    btree_cycle_id,
    is_real_lsn,
    page_lsn,
)
from protocol.lsn import MAX_LSN, Lsn
from protocol.pagestream import RelTag

ZERO: Final = -1  # ``RelFile.local`` value of a block known to be all zeros (no slot)
RELSEG_BLOCKS: Final = 131072


class Keep(IntEnum):
    """Why a written page may not leave the local cache (0: it may, once the safekeepers hold
    WAL up to its pd_lsn)."""

    NO = 0
    UNREAL_LSN = 1  # R3a: pd_lsn 0, GistBuildLSN, an unlogged fake LSN: WAL cannot rebuild it
    VM_PAGE = 2  # H2: visibilitymap_clear does not bump the VM page's LSN
    BTREE_CYCLE_ID = 3  # H3: redo zeroes btpo_cycleid, a running VACUUM needs it
    ALL_VISIBLE = 4  # H1: PD_ALL_VISIBLE without an LSN bump when wal_log_hints is off
    LOCAL_FILE = 5  # unlogged relations and init forks: never in WAL as pages
    NEW_DATABASE = 6  # H4: FILE_COPY copies carry the source's pd_lsn


class ReadRetry(Exception):
    """The file was truncated or unlinked while its remote reads were in flight: plan again."""


@attrs.define(eq=False)
class RelFile:
    """One segment file (``<relnode>[_fork][.segno]``) of a relation fork."""

    rel: RelTag
    segno: int
    size: int  # bytes
    remote_limit: int  # blocks below it not written here are the pageserver's at S
    keep_file: Keep = Keep.NO  # set for files in a database directory this compute created
    local: dict[int, int] = attrs.Factory(dict)  # block -> slot, or ZERO
    evicted: dict[int, int] = attrs.Factory(dict)  # block -> not_modified_since for a re-read
    epoch: int = 0  # bumped by truncate and unlink
    unlinked: bool = False

    def blkno(self, blk: int) -> int:
        """The block number of the relation fork (what GetPage names)."""
        return self.segno * RELSEG_BLOCKS + blk


@attrs.frozen
class RemoteRead:
    blk: int  # block of the segment file
    blkno: int  # block of the relation fork
    request_lsn: Lsn
    not_modified_since: Lsn


@attrs.frozen
class ReadPlan:
    file: RelFile
    epoch: int
    first_blk: int
    start: int  # byte offset of the read inside the first block
    length: int  # bytes the read returns (clamped to the file size)
    # per block: a slot (>= 0), ZERO, or -2 - i for the i-th remote read
    sources: list[int]
    remote: list[RemoteRead]


@attrs.define
class StoreMetrics:
    hits: int = 0  # blocks served from the local page file (or known zeros)
    misses: int = 0  # blocks read from the page service
    zero_reads: int = 0  # blocks past the pageserver's size or known zero
    writes: int = 0
    evictions: int = 0
    over_capacity: int = 0  # allocations past local_cache_size: nothing was evictable
    dropped_fsm_reads: int = 0


class PageStore:
    def __init__(
        self,
        cache: LocalPageFile,
        *,
        start_lsn: Lsn,
        primary: bool,
        durable_lsn: Callable[[], Lsn],
        wal_log_hints: bool,
        max_evicted_entries: int = 1 << 20,
    ) -> None:
        self.cache = cache
        self.start_lsn = start_lsn
        self.primary = primary
        self._durable_lsn = durable_lsn
        self.wal_log_hints = wal_log_hints
        self.metrics = StoreMetrics()
        # (spc, db, relnode) of every relation with an init fork: all its forks stay local.
        self.unlogged: set[tuple[int, int, int]] = set()
        self._slot_file: list[RelFile | None] = []
        self._slot_blk: list[int] = []
        self._slot_lsn: list[int] = []
        self._slot_keep = bytearray()
        self._hand = 0
        self.kept: dict[Keep, int] = dict.fromkeys(Keep, 0)
        # The evicted-LSN map is bounded as Neon's last-written-LSN cache: past the bound an
        # entry is dropped and its LSN raises a floor that every read without an entry uses
        # (a larger not_modified_since is always correct; it only makes the read wait).
        self.max_evicted_entries = max_evicted_entries
        self.evicted_entries = 0
        self.evicted_floor = Lsn(start_lsn)
        self._evicted_files: dict[int, RelFile] = {}

    # -- LSNs -----------------------------------------------------------------------------

    def durable_lsn(self) -> Lsn:
        """D: what the safekeepers hold. A read-only endpoint's WAL goes nowhere: D = S."""
        if not self.primary:
            return self.start_lsn
        return Lsn(max(self.start_lsn, self._durable_lsn()))

    @property
    def request_lsn(self) -> Lsn:
        """A primary reads the latest version (it is the only writer); a read-only endpoint
        reads the branch at S."""
        return MAX_LSN if self.primary else self.start_lsn

    # -- files ----------------------------------------------------------------------------

    def new_file(self, rel: RelTag, segno: int, nblocks_remote: int, *, keep: Keep = Keep.NO) -> RelFile:
        """A segment file; ``nblocks_remote`` blocks of it are on the pageserver at S (0 for a
        file this compute creates)."""
        if rel.forknum == INIT:
            self.unlogged.add((rel.spcnode, rel.dbnode, rel.relnode))
        return RelFile(rel, segno, nblocks_remote * BLCKSZ, nblocks_remote, keep)

    def keep_reason(self, f: RelFile) -> Keep:
        """Why every page of ``f`` stays local (or Keep.NO)."""
        if f.keep_file:
            return f.keep_file
        r = f.rel
        if r.forknum == INIT or (r.spcnode, r.dbnode, r.relnode) in self.unlogged:
            return Keep.LOCAL_FILE
        return Keep.NO

    def page_keep(self, f: RelFile, page: bytes | memoryview) -> Keep:
        """R3 and H1..H3 for one written page (H4 and unlogged files: ``keep_reason``)."""
        fork = f.rel.forknum
        if fork == FSM:
            return Keep.NO  # R5: FSM pages are hints
        if fork == VM:
            return Keep.VM_PAGE
        if not is_real_lsn(page_lsn(page)):
            return Keep.UNREAL_LSN
        if btree_cycle_id(page):
            return Keep.BTREE_CYCLE_ID
        if not self.wal_log_hints and all_visible_flag(page):
            return Keep.ALL_VISIBLE
        return Keep.NO

    # -- reads ----------------------------------------------------------------------------

    def plan_read(self, f: RelFile, off: int, size: int) -> ReadPlan:
        end = min(off + size, f.size)
        if end <= off:
            return ReadPlan(f, f.epoch, 0, 0, 0, [], [])
        first, last = off // BLCKSZ, (end - 1) // BLCKSZ
        sources: list[int] = []
        remote: list[RemoteRead] = []
        req = self.request_lsn
        m = self.metrics
        for blk in range(first, last + 1):
            slot = f.local.get(blk)
            if slot is not None:
                sources.append(slot)
                m.hits += 1
                continue
            nms = f.evicted.get(blk)
            if nms is None:
                if blk >= f.remote_limit:
                    sources.append(ZERO)  # extended here, or truncated and extended again
                    m.zero_reads += 1
                    continue
                nms = self.evicted_floor  # R1 (S, unless evicted entries were dropped)
            sources.append(-2 - len(remote))
            remote.append(RemoteRead(blk, f.blkno(blk), req, Lsn(nms)))
            m.misses += 1
        return ReadPlan(f, f.epoch, first, off - first * BLCKSZ, end - off, sources, remote)

    def assemble(self, plan: ReadPlan, pages: Sequence[bytes | memoryview]) -> bytes:
        """The bytes of a planned read, ``pages`` answering its remote reads in order. A block
        written while its remote read was in flight is served from the local page file (the
        newer version, R2)."""
        return bytes(self.assemble_into(plan, pages, bytearray(len(plan.sources) * BLCKSZ)))

    def assemble_into(self, plan: ReadPlan, pages: Sequence[bytes | memoryview], buf: bytearray) -> memoryview:
        """``assemble`` into ``buf`` (at least ``len(plan.sources)`` blocks): a view of it. One
        copy per page, no per-read allocation (a sequential scan's reads are 1 MiB)."""
        f = plan.file
        if f.epoch != plan.epoch:
            raise ReadRetry()
        if len(pages) != len(plan.remote):
            raise ValueError(f"{len(pages)} pages for {len(plan.remote)} remote reads")
        out = memoryview(buf)
        pos = 0
        local = f.local
        first = plan.first_blk
        for i, src in enumerate(plan.sources):
            if src < ZERO:
                slot = local.get(first + i)
                if slot is None:
                    page = pages[-2 - src]
                    if len(page) != BLCKSZ:
                        raise ValueError(f"a remote page of {len(page)} bytes")
                    out[pos : pos + BLCKSZ] = page
                    pos += BLCKSZ
                    continue
                src = slot
            out[pos : pos + BLCKSZ] = ZERO_PAGE if src == ZERO else self.cache.read(src)
            pos += BLCKSZ
        return out[plan.start : plan.start + plan.length]

    # -- writes ---------------------------------------------------------------------------

    def write_block(self, f: RelFile, blk: int, page: bytes | memoryview) -> None:
        """R2: the block's bytes are now these (the whole 8 KiB block)."""
        if len(page) != BLCKSZ:
            raise ValueError(f"write_block needs {BLCKSZ} bytes, got {len(page)}")
        self.metrics.writes += 1
        if f.evicted.pop(blk, None) is not None:
            self.evicted_entries -= 1
        slot = f.local.get(blk)
        if page == ZERO_PAGE:
            if slot is not None and slot != ZERO:
                self._free_slot(slot)
            f.local[blk] = ZERO
        else:
            if slot is None or slot == ZERO:
                slot = self._allocate()
                f.local[blk] = slot
                self._slot_file[slot] = f
                self._slot_blk[slot] = blk
            else:
                self.kept[Keep(self._slot_keep[slot])] -= 1
            self.cache.write(slot, page)
            # a file-level reason (H4) is for the file's life; unlogged is looked up at eviction
            keep = f.keep_file or self.page_keep(f, page)
            self._slot_lsn[slot] = page_lsn(page)
            self._slot_keep[slot] = keep
            self.kept[keep] += 1
        f.size = max(f.size, (blk + 1) * BLCKSZ)

    def truncate(self, f: RelFile, size: int) -> None:
        """R7: drop the blocks at or past the new end; what is re-extended reads as zeros."""
        f.epoch += 1
        nblocks = -(-size // BLCKSZ)
        for blk in [b for b in f.local if b >= nblocks]:
            slot = f.local.pop(blk)
            if slot != ZERO:
                self._free_slot(slot)
        for blk in [b for b in f.evicted if b >= nblocks]:
            del f.evicted[blk]
            self.evicted_entries -= 1
        f.remote_limit = min(f.remote_limit, nblocks)
        f.size = size

    def unlink(self, f: RelFile) -> None:
        self.truncate(f, 0)
        f.unlinked = True
        if f.rel.forknum == INIT:
            self.unlogged.discard((f.rel.spcnode, f.rel.dbnode, f.rel.relnode))

    # -- the local page file ------------------------------------------------------------------

    @property
    def bytes_cached(self) -> int:
        return self.cache.used * BLCKSZ

    def _allocate(self) -> int:
        if self.cache.full():
            victim = self._evict_one()
            if victim is None:
                self.metrics.over_capacity += 1
        slot = self.cache.allocate()
        if slot == len(self._slot_file):
            self._slot_file.append(None)
            self._slot_blk.append(0)
            self._slot_lsn.append(0)
            self._slot_keep.append(0)
        return slot

    def _free_slot(self, slot: int) -> None:
        self.kept[Keep(self._slot_keep[slot])] -= 1
        self._slot_file[slot] = None
        self._slot_keep[slot] = 0
        self.cache.release(slot)

    def evictable(self, slot: int, durable: Lsn) -> bool:
        f = self._slot_file[slot]
        if f is None or self._slot_keep[slot] or self.keep_reason(f):
            return False
        # R3b: the safekeepers hold the WAL up to pd_lsn (FSM pages are hints: always).
        return f.rel.forknum == FSM or self._slot_lsn[slot] <= durable

    def evict_slot(self, slot: int) -> None:
        """R4: the block is re-read at not_modified_since = max(pd_lsn, S)."""
        f = self._slot_file[slot]
        assert f is not None
        blk = self._slot_blk[slot]
        lsn = self._slot_lsn[slot]
        if f.rel.forknum == FSM and not (is_real_lsn(lsn) and lsn <= self.durable_lsn()):
            lsn = self.start_lsn  # R5: serve what the pageserver has
        del f.local[blk]
        f.evicted[blk] = max(lsn, self.start_lsn)
        self.evicted_entries += 1
        self._evicted_files[id(f)] = f
        self._free_slot(slot)
        self.metrics.evictions += 1
        if self.evicted_entries > self.max_evicted_entries:
            self._drop_evicted_entry()

    def _drop_evicted_entry(self) -> None:
        """Forget one evicted block's LSN: the floor rises to it (module docstring of
        ``compute.pagefs``, R4)."""
        while self._evicted_files:
            key, f = next(iter(self._evicted_files.items()))
            if not f.evicted:
                del self._evicted_files[key]
                continue
            blk = next(iter(f.evicted))
            self.evicted_floor = Lsn(max(self.evicted_floor, f.evicted.pop(blk)))
            self.evicted_entries -= 1
            return

    def _evict_one(self) -> int | None:
        """Clock: clear reference bits until an evictable unreferenced slot comes by; give up
        after two turns (everything kept: the cache grows past its bound)."""
        n = self.cache.slots
        if n == 0:
            return None
        durable = self.durable_lsn()
        ref = self.cache.ref
        for _ in range(2 * n):
            slot = self._hand
            self._hand = (slot + 1) % n
            if self._slot_file[slot] is None:
                continue
            if ref[slot]:
                ref[slot] = 0
                continue
            if self.evictable(slot, durable):
                self.evict_slot(slot)
                return slot
        return None

    def evict_all(self) -> int:
        """Evict every page the rules allow (tests, and ``POST /v1/evict``)."""
        durable = self.durable_lsn()
        n = 0
        for slot in range(self.cache.slots):
            if self.evictable(slot, durable):
                self.evict_slot(slot)
                n += 1
        return n
