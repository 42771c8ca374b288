"""The lone request's read path gives the batch path's answers and errors.

``execute_batch`` of one GetPage (``_execute_getpage``, ``PageReader.get_page``) writes the
bytes and counts ``_execute_getpages`` writes for the same request: a page, a zero page, a
per-page read error, a failed walk, a timed-out and a successful WAL wait.

``Timeline.get_page(key, lsn)`` (one page-cache lookup, ``read_path.get_one``) against
``Timeline.get_pages([(key, lsn)])[0]``, the legacy per-key oracle and a dict model, on random
timelines (puts, freezes, flushes, compactions, image layers, sometimes a branch), with the page
cache off and on (each read twice: the second often starts from a memorized page), and with
``validate_get`` on (the lane then defers to the general path) and off (the lane runs: checked by
counting ``get_one`` calls). Errors must be the same class with the same message: a missing key,
a read below the GC cutoff, a shut-down timeline.

``TimelinePageReader.get_page`` against ``get_pages([read])`` on a datadir timeline: pages in
layers and in memory, blocks past the end (zeros), a missing relation (``NotFound``), a missing
FSM fork (zeros), cold and warm size cache, a shut-down timeline (``Shutdown``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pageserver.page_service.config import PageServiceConfig
from pageserver.page_service.metrics import PageServiceMetrics
from pageserver.page_service.pipeline import (
    PagestreamContext,
    Pending,
    _execute_getpages,
    execute_batch,
)
from pageserver.page_service.reader import (
    PageRead,
    PageRequestError,
    ReadError,
    Shutdown,
    SingleTimeline,
)
from pageserver.page_service.timeline_adapter import TimelinePageReader
from pageserver.storage import read_path
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import Key
from pageserver.storage.reconstruct import MissingKeyError, PageReconstructError
from pageserver.storage.value import Value
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline, TimelineShutdownError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.pagestream import GetPageRequest, RelTag, ResponseWriter
from tests.pageserver.page_service_fakes import FakeTimeline
from tests.pageserver.test_page_service_timeline import NBLOCKS, REL, build_timeline, page
from tests.pageserver.test_timeline_mixed_lsn import (
    KEYS,
    OPS,
    _build,
    _config,
    _legacy_get,
    _model_value,
    _put_batch,
)

Result = bytes | PageReconstructError


def _equal(a: Result, b: Result) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    return type(a) is type(b) and str(a) == str(b)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops_spec=OPS,
    cache=st.booleans(),
    validate=st.booleans(),
    branch=st.booleans(),
    data=st.data(),
)
def test_get_page_equals_get_pages_of_one(
    ops_spec: list[tuple[str, list[tuple[int, str, str]], int]],
    cache: bool,
    validate: bool,
    branch: bool,
    data: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory(prefix="pagestore-getpage-") as d:
        tenant = Tenant(Path(d), TenantId.generate(), _config_with(cache, validate))

        async def go() -> None:
            tl, ops = await _build(tenant, ops_spec)
            if branch:
                # a child branched at the parent's tip, with writes of its own: reads walk
                # into the ancestor below the branch point
                cid = TimelineId.generate()
                child = await tenant.create_timeline(cid, ancestor=tl, ancestor_lsn=tl.last_record_lsn)
                cops = list(ops)
                await _put_batch(child, cops, [(i, "append", "c") for i in range(0, len(KEYS), 3)], 4)
                if data.draw(st.booleans(), label="flush child"):
                    await child.flush()
                tl, ops = child, cops
            lo, hi = int(tl.ancestor_lsn), int(tl.last_record_lsn)
            calls = 0
            real = read_path.get_one

            async def counting(*args: object) -> None:
                nonlocal calls
                calls += 1
                await real(*args)  # type: ignore[arg-type]

            read_path.get_one = counting  # type: ignore[assignment]
            try:
                reqs = data.draw(
                    st.lists(st.tuples(st.sampled_from(KEYS), st.integers(lo, hi)), min_size=1, max_size=12),
                    label="reads",
                )
                for key, lsn_i in reqs:
                    lsn = Lsn(lsn_i)
                    for _ in range(2 if cache else 1):
                        one = await tl.get_page(key, lsn)
                        (batch,) = await tl.get_pages([(key, lsn)])
                        assert _equal(one, batch), (key.hex(), lsn, one, batch)
                        legacy = await _legacy_get(tl, key, lsn)
                        assert _equal(one, legacy) or (
                            not isinstance(one, bytes) and type(one) is type(legacy)
                        ), (key.hex(), lsn, one, legacy)
                        expected = _model_value(ops, key, lsn)
                        if expected is None:
                            assert isinstance(one, MissingKeyError), (key.hex(), lsn, one)
                        else:
                            assert one == expected, (key.hex(), lsn, one, expected)
            finally:
                read_path.get_one = real
            if validate:
                assert calls == 0  # validate_get: the general path, which checks itself
            else:
                assert calls >= len(reqs) * (2 if cache else 1)
            event(f"cache={cache} validate={validate} branch={branch} hits={min(tl.page_cache.hits, 1)}")

        trio.run(go)
        trio.run(tenant.shutdown)


def _config_with(cache: bool, validate: bool) -> StorageConfig:
    return attrs.evolve(_config(1 << 20 if cache else 0), validate_get=validate)


async def _layered_timeline(path: Path, validate: bool) -> tuple[Tenant, Timeline]:
    tenant = Tenant(path, TenantId.generate(), attrs.evolve(_config(0), validate_get=validate))
    tid = TimelineId.generate()
    tl = await tenant.create_timeline(tid)
    ops: list[tuple[int, Key, Value]] = []
    for n in range(4):
        await _put_batch(tl, ops, [(i, "img" if n == 0 else "append", f"v{n}") for i in range(0, len(KEYS), 2)], 5)
        await tl.flush()
    return tenant, tl


@pytest.mark.parametrize("validate", [False, True])
async def test_get_page_errors_are_get_pages_errors(tmp_path: Path, validate: bool) -> None:
    """A key nobody wrote, a read below the GC cutoff, a shut-down timeline: the same error
    class and message from the lane and from the batch path."""
    tenant, tl = await _layered_timeline(tmp_path, validate)
    top = tl.last_record_lsn
    missing = KEYS[1]  # odd keys are never written
    one = await tl.get_page(missing, top)
    (batch,) = await tl.get_pages([(missing, top)])
    assert isinstance(one, MissingKeyError) and _equal(one, batch)
    tl.latest_gc_cutoff_lsn = Lsn(top - 2)
    one = await tl.get_page(KEYS[0], Lsn(top - 3))
    (batch,) = await tl.get_pages([(KEYS[0], Lsn(top - 3))])
    assert isinstance(one, PageReconstructError) and _equal(one, batch), (one, batch)
    assert await tl.get_page(KEYS[0], top) == (await tl.get_pages([(KEYS[0], top)]))[0]
    await tl.shutdown()
    with pytest.raises(TimelineShutdownError) as lane:
        await tl.get_page(KEYS[0], top)
    with pytest.raises(TimelineShutdownError) as general:
        await tl.get_pages([(KEYS[0], top)])
    assert str(lane.value) == str(general.value)
    await tenant.shutdown()


def _same_read(a: bytes | PageRequestError, b: bytes | PageRequestError) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    return type(a) is type(b) and str(a) == str(b)


async def test_page_reader_get_page_equals_get_pages(tmp_path: Path) -> None:
    tenant = await build_timeline(tmp_path / "t")
    tl = next(iter(tenant.timelines.values()))
    missing_rel = RelTag(1663, 5, 16385, 0)
    fsm = RelTag(REL.spcnode, REL.dbnode, REL.relnode, 1)
    reads = [
        PageRead(rel, blk, lsn)
        for lsn in (Lsn(0x150), Lsn(0x200))
        for rel in (REL, missing_rel, fsm)
        for blk in (0, 1, NBLOCKS - 1, NBLOCKS, NBLOCKS + 7)
    ]
    for warm in (False, True):
        lane_reader, batch_reader = TimelinePageReader(tl), TimelinePageReader(tl)
        if warm:  # the size cache holds every (fork, LSN) before the lane reads
            await lane_reader.get_pages(reads)
        for read in reads:
            one = await lane_reader.get_page(read)
            (batch,) = await batch_reader.get_pages([read])
            assert _same_read(one, batch), (read, one, batch)
        assert await lane_reader.get_page(PageRead(REL, 2, Lsn(0x200))) == page(2, 2)
        assert await lane_reader.get_page(PageRead(REL, 3, Lsn(0x200))) == page(3, 1)
    warm_reader = TimelinePageReader(tl)
    await warm_reader.get_pages(reads)
    await tl.shutdown()
    for reader in (warm_reader, TimelinePageReader(tl)):
        with pytest.raises(Shutdown):
            await reader.get_page(PageRead(REL, 0, Lsn(0x200)))
    await tenant.shutdown()


# -- the page service's batch of one: _execute_getpage against _execute_getpages ------------------


class _FailingRead(FakeTimeline):
    """``get_page``/``get_pages`` raise a ``PageRequestError`` (the walk itself failed)."""

    async def get_pages(self, reads: Sequence[PageRead]) -> list[bytes | PageRequestError]:
        raise ReadError("the walk failed")


@pytest.mark.parametrize(
    "case", ["page", "zero", "read error", "walk fails", "wait times out", "wait succeeds"]
)
async def test_execute_of_one_writes_what_the_batch_path_writes(case: str) -> None:
    """The same response bytes and the same request counts from the lone request's execution
    and from the batch execution of a batch of one, for every outcome of a GetPage."""
    rel = RelTag(1663, 5, 16384, 0)
    outputs: list[tuple[bytes, dict[tuple[str, ...], int]]] = []
    for path in ("lane", "batch"):
        tl = _FailingRead() if case == "walk fails" else FakeTimeline(last_record_lsn=0x1000)
        tl.fill(rel, 4, [0x800])
        tl.fill(RelTag(1663, 5, 666, 0), 0, [])
        lsn = Lsn(0x1000)
        blkno = 9 if case == "zero" else 2
        req_rel = RelTag(1663, 5, 666, 0) if case == "read error" else rel
        if case.startswith("wait"):
            lsn = Lsn(0x2000)  # beyond last_record_lsn: the request waits
        request = GetPageRequest(7, lsn, Lsn(0x800), req_rel, blkno)
        config = PageServiceConfig(wait_lsn_timeout_s=0.05)
        metrics = PageServiceMetrics.register(CollectorRegistry())
        ctx = PagestreamContext(3, SingleTimeline(tl), config, metrics)
        pending = Pending(request, tl, lsn, lsn > tl.last_record_lsn, None, 0.0)
        writer = ResponseWriter(3)
        async with trio.open_nursery() as nursery:
            if case == "wait succeeds":
                async def later(tl: FakeTimeline) -> None:
                    await trio.sleep(0.01)
                    tl.advance(0x2000)

                nursery.start_soon(later, tl)
            if path == "lane":
                await execute_batch([pending], writer, ctx)
            else:
                await _execute_getpages([pending], writer, ctx)
        outputs.append((bytes(writer.take()), dict(metrics.requests.values)))
    (lane, lane_counts), (batch, batch_counts) = outputs
    assert lane == batch
    assert lane_counts == batch_counts and sum(lane_counts.values()) == 1
    ok = case in ("page", "zero", "wait succeeds")
    assert lane_counts == {("get_page", "ok" if ok else "error"): 1}
