"""A burst's GetPages handled as a run: ``prepare_getpages`` (the run prepared at once) and
``fold_run`` / ``FoldChannel.send_run_nowait`` (the run folded at once).

Both are fast paths of the per-request path (``prepare``, ``can_fold`` one item at a time):
hypothesis checks they give the same items and batches, and counters show the fast paths are
taken (a mutant that always falls back to the per-request path fails them).
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.page_service import pipeline
from pageserver.page_service.config import PipelinedPipelining
from pageserver.page_service.fold import FoldChannel
from pageserver.page_service.pipeline import (
    Fatal,
    Item,
    Pending,
    ReadEntry,
    make_folding,
    prepare,
    prepare_getpages,
)
from pageserver.page_service.reader import BadRequest, NotFound, PageReader, SingleTimeline
from protocol.lsn import Lsn
from protocol.pagestream import GetPageRequest, RelTag, Request
from tests.pageserver.page_service_fakes import FakeTimeline

RELS = [RelTag(1663, 5, 16384, 0), RelTag(1663, 5, 16385, 0), RelTag(1663, 5, 0, 0),
        RelTag(1663, 5, 16384, 4), RelTag(1663, 5, 16384, 3)]
LSNS = [0, 0x100, 0x800, 0x1000, 0x1800, 0xFFFF_FFFF_FFFF_FFFF]


def _key(item: Item | ReadEntry) -> tuple[object, ...]:
    if isinstance(item, Pending):
        err = item.error
        return ("pending", item.request, item.timeline, item.lsn, item.needs_wait,
                None if err is None else (type(err), str(err)), item.received_at, item.foldable)
    if isinstance(item, Fatal):
        return ("fatal", type(item.error), str(item.error))
    raise AssertionError(f"unexpected {item!r}")


requests_st = st.lists(
    st.builds(
        GetPageRequest,
        st.integers(0, 1000),
        st.sampled_from(LSNS).map(Lsn),
        st.sampled_from(LSNS).map(Lsn),
        st.sampled_from(RELS),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(requests_st, st.sampled_from([0x800, 0x1000]), st.sampled_from([0, 0x100, 0x1000]))
def test_prepare_getpages_equals_prepare(
    requests: list[GetPageRequest], last: int, gc_cutoff: int
) -> None:
    tl = FakeTimeline(last_record_lsn=last, gc_cutoff_lsn=gc_cutoff)
    resolver = SingleTimeline(tl)
    out: list[ReadEntry] = []
    prepare_getpages(requests, 1.5, resolver, out)
    assert [_key(i) for i in out] == [_key(prepare(r, 1.5, resolver)) for r in requests]


class _PerRequest:
    """A resolver without ``constant`` (asked per request, like a sharded one) that fails
    for odd relnodes."""

    def __init__(self, reader: PageReader) -> None:
        self.reader = reader
        self.calls = 0

    def resolve(self, request: Request) -> PageReader:
        self.calls += 1
        if isinstance(request, GetPageRequest) and request.rel.relnode % 2:
            raise NotFound("not on this shard")
        return self.reader


@settings(max_examples=100, deadline=None)
@given(requests_st)
def test_prepare_getpages_asks_a_per_request_resolver_per_request(
    requests: list[GetPageRequest],
) -> None:
    tl = FakeTimeline()
    ours, theirs = _PerRequest(tl), _PerRequest(tl)
    out: list[ReadEntry] = []
    prepare_getpages(requests, 0.0, ours, out)
    assert [_key(i) for i in out] == [_key(prepare(r, 0.0, theirs)) for r in requests]
    assert ours.calls == theirs.calls == len(requests)


def test_prepare_getpages_prepares_a_valid_run_without_prepare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    real = pipeline.prepare

    def counting(*args: object) -> Item:
        nonlocal calls
        calls += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "prepare", counting)
    tl = FakeTimeline()
    requests = [GetPageRequest(i, Lsn(0x1000), Lsn(0), RELS[0], i) for i in range(32)]
    bad = GetPageRequest(99, Lsn(0x1000), Lsn(0), RELS[2], 0)  # relnode 0
    out: list[ReadEntry] = []
    prepare_getpages([*requests, bad], 0.0, SingleTimeline(tl), out)
    assert calls == 1  # only the request that fails a check, for its error's wording
    assert all(isinstance(p, Pending) and p.error is None for p in out[:32])
    last = out[32]
    assert isinstance(last, Pending) and last.error is not None and "relnode 0" in str(last.error)


# ---------------------------------------------------------------------------------------------
# fold_run against can_fold one by one

TIMELINES = [object(), object()]

item_st = st.one_of(
    st.tuples(
        st.sampled_from(RELS[:2]),
        st.integers(0, 5),
        st.sampled_from([0x100, 0x200, 0x300]),
        st.booleans(),  # needs_wait
        st.integers(0, 9),  # 0: a decided error (not foldable)
        st.integers(0, 9),  # 0: the other timeline
    ).map(
        lambda t: Pending(
            GetPageRequest(0, Lsn(t[2]), Lsn(0), t[0], t[1]),
            TIMELINES[t[5] == 0],
            Lsn(t[2]),
            t[3],
            None if t[4] else BadRequest("bad"),
            0.0,
        )
    ),
    st.just(Fatal(RuntimeError("x"))),
)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(item_st, min_size=1, max_size=12),
    st.lists(item_st, min_size=0, max_size=60),
    st.integers(0, 5),
    st.integers(1, 40),
    st.sampled_from(["scattered-lsn", "uniform-lsn"]),
)
def test_fold_run_agrees_with_can_fold_one_by_one(
    batch: list[Item], items: list[Item], start: int, max_batch_size: int, batching: str
) -> None:
    cfg = PipelinedPipelining(max_batch_size, batching)  # type: ignore[arg-type]
    can_fold, _ = make_folding(cfg)
    _, fold_run = make_folding(cfg)
    # a batch as FoldChannel builds it: its first item, then what can_fold took
    built: list[Item] = [batch[0]]
    for item in batch[1:]:
        if can_fold(built, item):
            built.append(item)
    start = min(start, len(items))
    expected = list(built)
    want = 0
    for item in items[start:]:
        if not can_fold(expected, item):
            break
        expected.append(item)
        want += 1
    got_batch = list(built)
    assert fold_run(got_batch, items, start) == want
    assert got_batch == expected


def test_a_uniform_run_folds_without_a_per_request_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks = 0
    real_allows = pipeline._LsnIndex.allows

    def counting(self: pipeline._LsnIndex, batch: list[Pending], item: Pending) -> bool:
        nonlocal checks
        checks += 1
        return real_allows(self, batch, item)

    monkeypatch.setattr(pipeline._LsnIndex, "allows", counting)
    ch = FoldChannel[Item](*make_folding(PipelinedPipelining(32, "scattered-lsn")))
    tl = TIMELINES[0]
    run: list[Item] = [
        Pending(GetPageRequest(i, Lsn(0x100), Lsn(0), RELS[0], i), tl, Lsn(0x100),  # type: ignore[arg-type]
                False, None, 0.0)
        for i in range(40)
    ]
    assert ch.send_run_nowait(run, 0) == 32  # the batch's room
    assert ch.pending() == 32
    assert ch.send_run_nowait(run, 32) == 0  # full: nothing done
    assert checks == 0


async def test_send_run_nowait_on_a_closed_or_abandoned_channel() -> None:
    ch = FoldChannel[int](lambda batch, item: True)
    assert ch.send_run_nowait([1, 2, 3], 1) == 2
    assert ch.send_run_nowait([1], 1) == 0  # nothing from start
    assert await ch.receive() == [2, 3]
    ch.close()
    with pytest.raises(trio.ClosedResourceError):
        ch.send_run_nowait([1], 0)
    gone = FoldChannel[int](lambda batch, item: True)
    gone.close_receiver()
    with pytest.raises(trio.BrokenResourceError):
        gone.send_run_nowait([1], 0)
