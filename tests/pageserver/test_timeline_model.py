"""Hypothesis state machine: a tenant's timelines against a plain dict model.

Rules: puts (images, Test append / init records) at increasing LSNs over a small key set,
freezes and flushes, compactions, forced image creation, GC, branches and restarts. After every
step, ``get`` and ``get_vectored`` at several LSNs (``validate_get`` on, so the legacy path runs
as the oracle too) must equal the model. Small thresholds make every mechanism fire often.

Each rule runs in its own ``trio.run``: the tenant uses the blocking IO engine and single
buffering, so no object is bound to one trio run.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pageserver.storage.config import StorageConfig
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.reconstruct import MissingKeyError
from pageserver.storage.value import Image, TestRecord, Value
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

T = TypeVar("T")

KEYS = [rel_block_key(1663, 5, 1000 + i // 6, 0, i % 6) for i in range(12)]

CONFIG = StorageConfig(
    checkpoint_distance=256,
    compaction_threshold=3,
    compaction_target_size=8192 * 3,
    image_creation_threshold=2,
    gc_horizon=50,
    pitr_interval_s=0,
    validate_get=True,
    page_cache_size=4096,
    index_cache_blocks=4,
    write_buffer_size=256,
    double_buffering=False,
    max_vectored_read_bytes=96,
)


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return trio.run(fn)


class ModelTimeline:
    def __init__(self, ancestor: ModelTimeline | None, ancestor_lsn: int) -> None:
        self.ancestor = ancestor
        self.ancestor_lsn = ancestor_lsn
        self.ops: list[tuple[int, Key, Value]] = []  # in LSN order

    def value(self, key: Key, lsn: int) -> bytes | None:
        history: list[Value] = []
        tl: ModelTimeline | None = self
        limit = lsn
        while tl is not None:
            history[:0] = [v for op_lsn, k, v in tl.ops if k == key and op_lsn <= limit]
            limit = min(limit, tl.ancestor_lsn)
            tl = tl.ancestor
        page: bytes | None = None
        for v in history:
            if isinstance(v, Image):
                page = v.data
            elif isinstance(v, TestRecord):
                base = b"" if v.clear or page is None else page
                page = base + v.append.encode()
        return page

    def truncate(self, lsn: int) -> None:
        self.ops = [op for op in self.ops if op[0] <= lsn]


class TimelineMachine(RuleBasedStateMachine):
    timelines = Bundle("timelines")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="pagestore-model-"))
        self.tenant_id = TenantId.generate()
        self.tenant = Tenant(self.dir, self.tenant_id, CONFIG)
        self.models: dict[TimelineId, ModelTimeline] = {}

    def teardown(self) -> None:
        run(self.tenant.shutdown)
        shutil.rmtree(self.dir, ignore_errors=True)

    def tl(self, tid: TimelineId) -> Timeline:
        return self.tenant.timelines[tid]

    @initialize(target=timelines)
    def create_root(self) -> TimelineId:
        tid = TimelineId.generate()
        run(lambda: self.tenant.create_timeline(tid))
        self.models[tid] = ModelTimeline(None, 0)
        return tid

    @rule(
        tid=timelines,
        writes=st.lists(
            st.tuples(st.sampled_from(KEYS), st.sampled_from(["img", "append", "init"]), st.text("abc", min_size=1, max_size=6)),
            min_size=1,
            max_size=10,
        ),
        step=st.integers(1, 40),
    )
    def put_record(self, tid: TimelineId, writes: list[tuple[Key, str, str]], step: int) -> None:
        tl, model = self.tl(tid), self.models[tid]
        lsn = Lsn(tl.last_record_lsn + step)
        batch: dict[Key, Value] = {}
        for key, kind, text in writes:
            exists = model.value(key, lsn) is not None or key in batch
            value: Value
            if kind == "img" or not exists:
                value = Image(f"{text}@{lsn}".encode()) if kind != "init" else TestRecord.wal_init(text)
            elif kind == "init":
                value = TestRecord.wal_init(text)
            else:
                value = TestRecord.wal_append(f",{text}")
            # one value per key per LSN: a record touches a page once
            batch.setdefault(key, value)

        async def go() -> None:
            for key, value in batch.items():
                await tl.put(key, lsn, value)
            tl.finish_write(lsn)

        run(go)
        model.ops.extend((lsn, key, value) for key, value in batch.items())

    @rule(tid=timelines)
    def flush(self, tid: TimelineId) -> None:
        run(self.tl(tid).flush)

    @rule(tid=timelines)
    def compact(self, tid: TimelineId) -> None:
        run(self.tl(tid).compact)

    @rule(tid=timelines)
    def create_images(self, tid: TimelineId) -> None:
        tl = self.tl(tid)

        async def go() -> None:
            await tl.flush()
            await tl.compact(force_image=True)

        run(go)

    @rule()
    def gc(self) -> None:
        run(self.tenant.gc)

    @precondition(lambda self: len(self.models) < 4)
    @rule(target=timelines, parent=timelines, data=st.data())
    def branch(self, parent: TimelineId, data: st.DataObject) -> TimelineId:
        ptl = self.tl(parent)
        lo = max(ptl.latest_gc_cutoff_lsn, ptl.ancestor_lsn)
        hi = ptl.disk_consistent_lsn  # WAL above it is not re-ingested by this model
        lsn = Lsn(data.draw(st.integers(min(lo, hi), hi), label="branch lsn"))
        tid = TimelineId.generate()
        run(lambda: self.tenant.create_timeline(tid, ancestor=ptl, ancestor_lsn=lsn))
        self.models[tid] = ModelTimeline(self.models[parent], lsn)
        return tid

    @rule()
    def restart(self) -> None:
        run(self.tenant.shutdown)
        self.tenant = run(lambda: Tenant.load(self.dir, self.tenant_id, CONFIG))
        for tid, model in self.models.items():
            tl = self.tl(tid)
            # in-memory data is lost; a real pageserver re-ingests it from the safekeepers
            model.truncate(tl.disk_consistent_lsn)
            assert tl.last_record_lsn == tl.disk_consistent_lsn

    def _low_lsn(self, tl: Timeline) -> int:
        return max(tl.latest_gc_cutoff_lsn, tl.ancestor_lsn)

    def _check(self, tid: TimelineId, lsn: Lsn) -> None:
        tl, model = self.tl(tid), self.models[tid]

        async def go() -> None:
            results = await tl.get_vectored_results(KEYS, lsn)
            for key in KEYS:
                expected = model.value(key, lsn)
                got = results[key]
                if expected is None:
                    assert isinstance(got, MissingKeyError), (key.hex(), lsn, got)
                else:
                    assert got == expected, (key.hex(), lsn, got, expected)
            for key in KEYS[:3]:
                expected = model.value(key, lsn)
                if expected is not None:
                    assert await tl.get(key, lsn) == expected

        run(go)

    @rule(tid=timelines, data=st.data())
    def check_random_lsn(self, tid: TimelineId, data: st.DataObject) -> None:
        tl = self.tl(tid)
        lo = self._low_lsn(tl)
        lsn = Lsn(data.draw(st.integers(lo, max(lo, tl.last_record_lsn)), label="read lsn"))
        self._check(tid, lsn)

    @invariant()
    def reads_equal_model(self) -> None:
        for tid in self.models:
            tl = self.tl(tid)
            lo = self._low_lsn(tl)
            for lsn in {lo, (lo + tl.last_record_lsn) // 2, tl.last_record_lsn}:
                self._check(tid, Lsn(lsn))


TimelineMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=50, deadline=None
)
TestTimelineModel = TimelineMachine.TestCase
