"""The pipeline's hand-offs: ``HandoffQueue``, ``FoldChannel``, the scattered-lsn index,
Reading's direct fold (Batching's step run by Reading while Batching is idle) and its fast
lane (a lone request answered by Reading while Execution is idle).

The direct fold, the fast lane and the LSN index are fast paths of a general path; these tests show they agree
with it (hypothesis against a naive oracle; the serial-oracle tests in
``test_page_service_pipeline.py`` cover the responses) and that they are really taken (a
mutant that never takes them fails the task-step count below).
"""

from __future__ import annotations

import os
import socket

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.page_service import pipeline
from pageserver.page_service.config import (
    PageServiceConfig,
    PipelinedPipelining,
    SerialPipelining,
)
from pageserver.page_service.fold import FoldChannel, HandoffQueue
from pageserver.page_service.pipeline import (
    Item,
    PagestreamContext,
    Pending,
    make_can_fold,
    serve_pagestream_bytes,
)
from pageserver.page_service.reader import SingleTimeline
from protocol.lsn import Lsn
from protocol.pagestream import GetPageRequest, GetPageResponse, RelTag, StreamEnd
from protocol.pgwire import messages as m
from tests.pageserver.page_service_fakes import (
    FakeTimeline,
    decode_all,
    frame_requests,
    page_image,
)

REL = RelTag(1663, 5, 16384, 0)
REL2 = RelTag(1663, 5, 16385, 0)
MAX = Lsn(0xFFFF_FFFF_FFFF_FFFF)

# ---------------------------------------------------------------------------------------------
# HandoffQueue


async def test_handoff_queue_is_fifo_and_bounded() -> None:
    q = HandoffQueue[int](2)
    assert q.put_nowait(1) and q.put_nowait(2)
    assert not q.put_nowait(3)  # full: nothing done
    got: list[int] = []

    async def consume() -> None:
        while True:
            try:
                got.append(await q.get())
            except trio.EndOfChannel:
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await q.put(3)  # parks until the consumer makes room
        await q.put(4)
        q.close()
    assert got == [1, 2, 3, 4]


async def test_handoff_queue_receiver_idle_only_when_parked_on_empty() -> None:
    q = HandoffQueue[int](4)
    assert not q.receiver_idle  # nobody parked yet
    async with trio.open_nursery() as nursery:
        got: list[int] = []

        async def one() -> None:
            got.append(await q.get())

        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        assert _idle(q)
        assert q.put_nowait(7)
        assert not _idle(q)  # woken: it holds (or is about to hold) the item
    assert got == [7]


def _idle(q: HandoffQueue[int]) -> bool:
    return q.receiver_idle  # a call, so the type checker does not keep an earlier answer


async def test_handoff_queue_cancelled_get_takes_nothing() -> None:
    q = HandoffQueue[int](4)
    with trio.move_on_after(0.01):
        await q.get()
    assert not _idle(q)
    assert q.put_nowait(5)
    assert await q.get() == 5


async def test_handoff_queue_receiver_gone_breaks_a_parked_sender() -> None:
    q = HandoffQueue[int](1)
    assert q.put_nowait(1)
    async with trio.open_nursery() as nursery:

        async def drop() -> None:
            await trio.testing.wait_all_tasks_blocked()
            q.close_receiver()

        nursery.start_soon(drop)
        with pytest.raises(trio.BrokenResourceError):
            await q.put(2)


# ---------------------------------------------------------------------------------------------
# FoldChannel


async def test_fold_channel_folds_until_taken_and_parks_on_refusal() -> None:
    ch = FoldChannel[int](lambda batch, item: len(batch) < 3)
    for i in range(3):
        assert ch.send_nowait(i)
    assert not ch.send_nowait(3)
    batches: list[list[int]] = []
    async with trio.open_nursery() as nursery:

        async def take() -> None:
            while True:
                try:
                    batches.append(await ch.receive())
                except trio.EndOfChannel:
                    return

        nursery.start_soon(take)
        await ch.send(3)  # parks until the first batch is taken
        ch.close()
    assert batches == [[0, 1, 2], [3]]


async def test_fold_channel_cancelled_receive_leaves_the_batch() -> None:
    ch = FoldChannel[int](lambda batch, item: True)
    with trio.move_on_after(0.01):
        await ch.receive()
    assert ch.send_nowait(1)
    assert await ch.receive() == [1]


async def test_fold_channel_receiver_gone_breaks_a_parked_sender() -> None:
    ch = FoldChannel[int](lambda batch, item: False)
    assert ch.send_nowait(1)
    async with trio.open_nursery() as nursery:

        async def drop() -> None:
            await trio.testing.wait_all_tasks_blocked()
            ch.close_receiver()

        nursery.start_soon(drop)
        with pytest.raises(trio.BrokenResourceError):
            await ch.send(2)


# ---------------------------------------------------------------------------------------------
# The scattered-lsn index against the rule it implements


def _pending(rel: RelTag, blkno: int, lsn: int, timeline: object) -> Pending:
    return Pending(
        GetPageRequest(0, Lsn(lsn), Lsn(0), rel, blkno),
        timeline,  # type: ignore[arg-type]
        Lsn(lsn),
        False,
        None,
        0.0,
    )


def _naive_allows(batch: list[Item], item: Pending, max_batch_size: int) -> bool:
    """protocols.md's scattered-lsn rule, by rescanning the batch (the old implementation)."""
    if len(batch) >= max_batch_size:
        return False
    req = item.request
    assert isinstance(req, GetPageRequest)
    for other in batch:
        assert isinstance(other, Pending) and isinstance(other.request, GetPageRequest)
        if (
            other.request.blkno == req.blkno
            and other.lsn != item.lsn
            and other.request.rel == req.rel
        ):
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([REL, REL2]),
            st.integers(0, 5),
            st.sampled_from([0x100, 0x200, 0x300]),
            st.booleans(),  # Execution takes the batch before this item arrives
        ),
        min_size=1,
        max_size=80,
    ),
    st.integers(1, 40),
)
def test_lsn_index_agrees_with_rescanning_the_batch(
    items: list[tuple[RelTag, int, int, bool]], max_batch_size: int
) -> None:
    can_fold = make_can_fold(PipelinedPipelining(max_batch_size, "scattered-lsn"))
    timeline = object()
    batch: list[Item] = []
    for rel, blkno, lsn, taken in items:
        if taken:
            batch = []  # a new list, as FoldChannel.receive leaves behind
        item = _pending(rel, blkno, lsn, timeline)
        if batch:
            expected = _naive_allows(batch, item, max_batch_size)
            assert can_fold(batch, item) is expected
            if not expected:
                batch = []
        batch.append(item)


# ---------------------------------------------------------------------------------------------
# Reading folds directly while Batching is idle


class _StepCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] = self.steps.get(task.name, 0) + 1


async def _steps_at_queue_depth_1(
    tl: FakeTimeline, requests: list[GetPageRequest], expect: list[bytes]
) -> dict[str, int]:
    """Send ``requests`` one at a time (each after the previous answer) to a pipelined
    stream; return the steps each task took meanwhile."""
    ctx = PagestreamContext(
        3,
        SingleTimeline(tl),
        PageServiceConfig(
            page_service_pipelining=PipelinedPipelining(32, "scattered-lsn"),
            wait_lsn_timeout_s=30.0,
        ),
    )
    counter = _StepCounter()
    client, server = trio.testing.memory_stream_pair()
    outcome: list[StreamEnd] = []

    async def serve() -> None:
        outcome.append(await serve_pagestream_bytes(server, ctx))
        await server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        trio.lowlevel.add_instrument(counter)
        try:
            for req, page in zip(requests, expect, strict=True):
                await client.send_all(frame_requests([req], 3))
                raw = b""
                while len(raw) < 5 + 8234:
                    raw += await client.receive_some()
                assert decode_all(raw, [req], 3) == [GetPageResponse(req, page)]
        finally:
            trio.lowlevel.remove_instrument(counter)
        await client.send_eof()
    assert outcome == [StreamEnd.TERMINATE]
    return counter.steps


async def test_unbatchable_traffic_takes_the_fast_lane() -> None:
    """At queue depth 1 Reading answers each request itself (nothing to batch it with, Execution
    idle): neither Batching nor Execution is woken per request, no hand-off at all.

    (Both tasks still exist and take over whenever a request arrives while Execution is busy
    or with others: the folding tests in ``test_page_service_pipeline.py`` exercise that.)
    """
    tl = FakeTimeline()
    tl.fill(REL, 16, [0x100])
    requests = [GetPageRequest(i, MAX, Lsn(0x100), REL, i % 16) for i in range(40)]
    steps = await _steps_at_queue_depth_1(
        tl, requests, [tl.versions[(REL, r.blkno)][0][1] for r in requests]
    )
    assert steps.get("pagestream.read", 0) >= len(requests)
    # Started, parked once, woken at the end: a handful of steps, not one per request.
    assert steps.get("pagestream.execute", 0) <= 3
    assert steps.get("pagestream.batch", 0) <= 3
    assert len(tl.get_pages_calls) == len(requests)


async def test_a_request_that_waits_for_wal_leaves_the_fast_lane() -> None:
    """A lone request that must wait for WAL goes to Execution, so that Reading stays free
    to read (and answer) what follows while it waits."""
    tl = FakeTimeline()
    tl.fill(REL, 16, [0x100])
    waiting = GetPageRequest(1, MAX, Lsn(0x2000), REL, 3)  # not_modified_since ahead

    async def advance_later() -> None:
        await trio.sleep(0.05)
        tl.put_page(REL, 3, 0x2000)
        tl.advance(0x2000)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(advance_later)
        steps = await _steps_at_queue_depth_1(tl, [waiting], [page_image(REL, 3, 0x2000)])
    # woken for it and again when its WAL arrives (the fast lane leaves Execution at one step)
    assert steps.get("pagestream.execute", 0) >= 3


async def test_fold_channel_receive_on_empty_batch_is_a_cancellation_point() -> None:
    """An empty ``receive`` parks without checking for cancellation first: the park is the
    check. Cancelled before it starts, it raises and takes nothing; the channel still works."""
    ch = FoldChannel[int](lambda batch, item: True)
    with trio.CancelScope() as scope:
        scope.cancel()
        await ch.receive()
        raise AssertionError("not reached: receive must raise Cancelled")
    assert scope.cancelled_caught
    assert ch.send_nowait(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        await ch.receive()  # a batch is pending: the cancel still wins, nothing taken
    assert ch.pending() == 1
    assert await ch.receive() == [1]
    ch.close()
    with pytest.raises(trio.EndOfChannel):
        await ch.receive()


# ---------------------------------------------------------------------------------------------
# Reading on a real socket: park first after a drained read (pipelined only)


class _CountingOs:
    """Stands in for ``os`` in the pipeline module: counts reads that found nothing."""

    def __init__(self) -> None:
        self.eagain = 0

    def read(self, fd: int, n: int) -> bytes:
        try:
            return os.read(fd, n)
        except BlockingIOError:
            self.eagain += 1
            raise

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)


def _socket_pair() -> tuple[socket.socket, trio.SocketStream]:
    ours, theirs = socket.socketpair()
    return ours, trio.SocketStream(trio.socket.from_stdlib_socket(theirs))


async def _answer_in_rounds(
    config: PageServiceConfig, monkeypatch: pytest.MonkeyPatch, rounds: int, depth: int
) -> int:
    """``depth`` requests at a time over a socketpair, each round sent once the previous one
    is answered; returns how many reads of the server found EAGAIN."""
    counting = _CountingOs()
    monkeypatch.setattr(pipeline, "os", counting)
    tl = FakeTimeline()
    tl.fill(REL, 16, [0x100])
    ctx = PagestreamContext(3, SingleTimeline(tl), config)
    ours, server = _socket_pair()
    client = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_pagestream_bytes, server, ctx)
        for r in range(rounds):
            reqs = [
                GetPageRequest(r * depth + i, MAX, Lsn(0x100), REL, (r + i) % 16)
                for i in range(depth)
            ]
            await client.send_all(frame_requests(reqs, 3))
            raw = b""
            while len(raw) < depth * (5 + 8234):
                raw += await client.receive_some()
            assert decode_all(raw, reqs, 3) == [
                GetPageResponse(req, tl.versions[(REL, req.blkno)][0][1]) for req in reqs
            ]
        await client.send_all(m.encode(m.CopyDone()))
    await client.aclose()
    return counting.eagain


PIPELINED = PageServiceConfig(page_service_pipelining=PipelinedPipelining(32, "scattered-lsn"))
SERIAL = PageServiceConfig(page_service_pipelining=SerialPipelining())


async def test_pipelined_reading_parks_instead_of_reading_what_cannot_be_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst handed to Execution is answered only after Reading loops back to the socket,
    so after a drained read (nothing written since) Reading parks at once instead of failing
    a read with EAGAIN per burst; serial mode reads first."""
    n = 30
    assert await _answer_in_rounds(PIPELINED, monkeypatch, n, 2) <= 2
    assert await _answer_in_rounds(SERIAL, monkeypatch, n, 2) >= n - 2


async def test_after_its_own_write_reading_reads_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """At queue depth 1 the pipeline answers in the fast lane, and after its own write the
    client's next request may already be there: like serial mode, Reading tries the read
    before parking. (Here the client runs in the same thread, so the try always fails; over
    a real connection it mostly succeeds and saves the run-loop iteration.)"""
    n = 30
    assert await _answer_in_rounds(PIPELINED, monkeypatch, n, 1) >= n - 2
    assert await _answer_in_rounds(SERIAL, monkeypatch, n, 1) >= n - 2


@settings(max_examples=25, deadline=None)
@given(
    bursts=st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=6), min_size=1, max_size=6),
    cut=st.integers(1, 300),
)
def test_pipelined_over_a_socket_answers_like_serial(bursts: list[list[int]], cut: int) -> None:
    """Bursts sent in pieces while the pipeline may be parked after a drained read (or may
    have guessed wrong and parked with bytes already there): the responses are the serial
    oracle's, byte for byte."""

    async def run(config: PageServiceConfig) -> bytes:
        tl = FakeTimeline()
        tl.fill(REL, 16, [0x100])
        ctx = PagestreamContext(3, SingleTimeline(tl), config)
        ours, server = _socket_pair()
        client = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        raw = bytearray()
        want = sum(len(burst) for burst in bursts) * (5 + 8234)

        async def receive_responses() -> None:
            # Read while sending, as a client does: the serial server does not read while its
            # send is blocked, so a client that only reads after its last byte deadlocks once
            # the responses in flight fill the socket's buffer.
            nonlocal raw
            while len(raw) < want:
                raw += await client.receive_some()

        reqid = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_pagestream_bytes, server, ctx)
            async with trio.open_nursery() as receiving:
                receiving.start_soon(receive_responses)
                for burst in bursts:
                    wire = bytearray()
                    for blk in burst:
                        wire += frame_requests([GetPageRequest(reqid, MAX, Lsn(0x100), REL, blk)], 3)
                        reqid += 1
                    for at in range(0, len(wire), cut):
                        await client.send_all(wire[at : at + cut])
                        await trio.lowlevel.checkpoint()
            await client.send_all(m.encode(m.CopyDone()))
        await client.aclose()
        return bytes(raw)

    serial = trio.run(run, PageServiceConfig(page_service_pipelining=SerialPipelining()))
    for size in (1, 32):
        config = PageServiceConfig(
            page_service_pipelining=PipelinedPipelining(size, "scattered-lsn")
        )
        assert trio.run(run, config) == serial


# ---------------------------------------------------------------------------------------------
# Metrics per batch: one time-in-batcher observation per run of requests read together


@settings(max_examples=100, deadline=None)
@given(
    bursts=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    kinds=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_observe_per_run_matches_one_observation_per_request(
    bursts: list[int], kinds: list[bool]
) -> None:
    from prometheus_client import CollectorRegistry

    from pageserver.page_service.metrics import PageServiceMetrics
    from protocol.pagestream import ExistsRequest

    batch: list[Pending] = []
    for b, size in enumerate(bursts):
        for _ in range(size):
            i = len(batch)
            request = (
                GetPageRequest(i, MAX, Lsn(0x100), REL, i)
                if kinds[i]
                else ExistsRequest(i, MAX, Lsn(0x100), REL)
            )
            batch.append(Pending(request, None, Lsn(0x100), False, None, 0.001 * (b % 3)))
    taken = 0.5
    grouped = PageServiceMetrics.register(CollectorRegistry())
    pipeline._observe(grouped, batch, taken)
    oracle = PageServiceMetrics.register(CollectorRegistry())
    for p in batch:
        oracle.time_in_batcher_seconds.observe(taken - p.received_at)
    got, want = grouped.time_in_batcher_seconds, oracle.time_in_batcher_seconds
    assert got._counts == want._counts
    assert got.sum == pytest.approx(want.sum)
    assert grouped.getpage_execution_seconds.count == sum(kinds[: len(batch)])
    assert grouped.batch_size.count == 1 and grouped.batch_size.sum == len(batch)
