"""The pagestream pipeline over memory streams with a mock clock.

Covers folding up to max_batch_size, batches never mixing timelines, uniform- vs scattered-lsn,
a waiting request not holding back folded ones, the serial handler as the byte-exact oracle
(hypothesis over request sequences and TCP segmentations), teardown on errors in every stage
with no task left, shutdown with 57P01, hostile input, and metrics.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pageserver.page_service.config import (
    PageServiceConfig,
    PipelinedPipelining,
    SerialPipelining,
    structure_config,
)
from pageserver.page_service.fold import ReceiverGone
from pageserver.page_service.metrics import PageServiceMetrics
from pageserver.page_service.pipeline import PagestreamContext, _unwrapped, serve_pagestream_bytes
from pageserver.page_service.reader import (
    NotFound,
    PageReader,
    Reconnect,
    Shutdown,
    SingleTimeline,
)
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn
from protocol.pagestream import (
    BLCKSZ,
    DbSizeRequest,
    DbSizeResponse,
    ErrorResponse,
    ExistsRequest,
    ExistsResponse,
    GetPageRequest,
    GetPageResponse,
    GetSlruSegmentRequest,
    GetSlruSegmentResponse,
    NblocksRequest,
    NblocksResponse,
    PagestreamVersion,
    RelTag,
    Request,
    SlruKind,
    StreamEnd,
)
from tests.pageserver.page_service_fakes import (
    ZERO_PAGE,
    FakeTimeline,
    decode_all,
    frame_requests,
    page_image,
    slru_segment,
)

MAX = Lsn(0xFFFF_FFFF_FFFF_FFFF)
REL = RelTag(1663, 5, 16384, 0)
REL2 = RelTag(1663, 5, 16385, 0)
OLD, NEW = 0x100, 0x800  # versions in the fake; last_record_lsn is 0x1000


def gp(blk: int, lsn: int = MAX, nms: int = 0x100, rel: RelTag = REL, reqid: int = 0) -> GetPageRequest:
    return GetPageRequest(reqid, Lsn(lsn), Lsn(nms), rel, blk)


def make_timeline(**kw: float) -> FakeTimeline:
    tl = FakeTimeline(**kw)  # type: ignore[arg-type]
    tl.fill(REL, 16, [OLD, NEW])
    tl.fill(REL2, 4, [OLD])
    tl.put_page(RelTag(1663, 5, 666, 0), 0, 0x900)  # blk 1 of rel 666 fails to reconstruct
    tl.slru[(SlruKind.CLOG, 0)] = slru_segment(7)
    return tl


def pipelined(max_batch_size: int = 32, batching: str = "scattered-lsn") -> PageServiceConfig:
    return PageServiceConfig(
        page_service_pipelining=PipelinedPipelining(max_batch_size, batching),  # type: ignore[arg-type]
        wait_lsn_timeout_s=0.5,
    )


SERIAL = PageServiceConfig(page_service_pipelining=SerialPipelining(), wait_lsn_timeout_s=0.5)


def ctx_for(
    reader: PageReader | None = None,
    config: PageServiceConfig | None = None,
    version: PagestreamVersion = 3,
    **kw: object,
) -> PagestreamContext:
    return PagestreamContext(
        version,
        kw.pop("resolver", None) or SingleTimeline(reader or make_timeline()),  # type: ignore[arg-type]
        config or pipelined(),
        **kw,  # type: ignore[arg-type]
    )


async def run_stream(
    ctx: PagestreamContext, chunks: Sequence[bytes], *, eof: bool = True
) -> tuple[StreamEnd | BaseException, bytes]:
    """Serve one pagestream over a memory stream pair; return its outcome and the bytes sent."""
    client, server = trio.testing.memory_stream_pair()
    outcome: StreamEnd | BaseException | None = None

    async def serve() -> None:
        nonlocal outcome
        try:
            outcome = await serve_pagestream_bytes(server, ctx)
        except Exception as exc:
            outcome = exc
        finally:
            await server.aclose()

    received = bytearray()
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            try:
                for chunk in chunks:
                    await client.send_all(chunk)
                if eof:
                    await client.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            while data := await client.receive_some():
                received += data
    assert outcome is not None
    assert pagestream_tasks() == []
    return outcome, bytes(received)


def pagestream_tasks() -> list[str]:
    """Names of pipeline tasks still alive anywhere in this trio run."""
    names: list[str] = []

    def walk(task: trio.lowlevel.Task) -> None:
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                names.append(child.name)
                walk(child)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    walk(root)
    return [n for n in names if n.startswith("pagestream.")]


def expected_page(tl: FakeTimeline, req: GetPageRequest) -> bytes:
    lsn = min(tl.last_record_lsn, req.request_lsn)
    versions = [p for v, p in tl.versions.get((req.rel, req.blkno), []) if v <= lsn]
    return versions[-1] if versions else ZERO_PAGE


# ---------------------------------------------------------------------------------------------
# Folding


async def test_folding_up_to_max_batch_size(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    requests = [gp(i % 16, reqid=i) for i in range(100)]
    outcome, raw = await run_stream(ctx_for(tl, pipelined(8)), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    responses = decode_all(raw, requests, 3)
    assert responses == [GetPageResponse(r, expected_page(tl, r)) for r in requests]
    sizes = [len(call) for call in tl.get_pages_calls]
    assert sum(sizes) == 100
    assert max(sizes) == 8 and all(s <= 8 for s in sizes)
    assert len(sizes) < 100 // 4  # batching really happened
    # batches are contiguous runs of requests, in order
    flat = [(read.rel, read.blkno) for call in tl.get_pages_calls for read in call]
    assert flat == [(r.rel, r.blkno) for r in requests]


async def test_max_batch_size_one_never_batches(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    requests = [gp(i % 16, reqid=i) for i in range(20)]
    outcome, raw = await run_stream(ctx_for(tl, pipelined(1)), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    assert [len(c) for c in tl.get_pages_calls] == [1] * 20
    assert len(decode_all(raw, requests, 3)) == 20


async def test_non_getpage_requests_break_batches(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    requests: list[Request] = [gp(1), gp(2), gp(3)]
    requests += [NblocksRequest(0, MAX, Lsn(OLD), REL)]
    requests += [gp(4), gp(5)]
    outcome, raw = await run_stream(ctx_for(tl), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    for call in tl.get_pages_calls:
        blocks = {r.blkno for r in call}
        assert not (blocks & {1, 2, 3} and blocks & {4, 5})
    responses = decode_all(raw, requests, 3)
    assert responses[3] == NblocksResponse(requests[3], 16)  # type: ignore[arg-type]


@attrs.frozen
class ByRelnode:
    """Routes odd relnodes to one timeline and even ones to another (like shards)."""

    odd: FakeTimeline
    even: FakeTimeline

    def resolve(self, request: Request) -> PageReader:
        relnode = request.rel.relnode if isinstance(request, GetPageRequest) else 0
        return self.odd if relnode % 2 else self.even


async def test_batches_never_mix_timelines(autojump_clock: trio.testing.MockClock) -> None:
    odd, even = make_timeline(read_delay_s=0.001), make_timeline(read_delay_s=0.001)
    rel_odd, rel_even = RelTag(1663, 5, 16385, 0), RelTag(1663, 5, 16384, 0)
    odd.fill(rel_odd, 8, [OLD])
    requests = [gp(i % 4, rel=rel_odd if (i // 3) % 2 else rel_even, reqid=i) for i in range(60)]
    ctx = ctx_for(resolver=ByRelnode(odd, even))
    outcome, raw = await run_stream(ctx, [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    assert all(r.rel == rel_odd for call in odd.get_pages_calls for r in call)
    assert all(r.rel == rel_even for call in even.get_pages_calls for r in call)
    assert max(len(c) for c in odd.get_pages_calls + even.get_pages_calls) > 1
    assert decode_all(raw, requests, 3) == [
        GetPageResponse(r, expected_page(odd if r.rel == rel_odd else even, r)) for r in requests
    ]


async def test_uniform_lsn_breaks_on_lsn_change(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    # alternate between two effective LSNs: 0x1000 (latest) and 0x200 (a replica's LSN)
    requests = [gp(i % 16, lsn=MAX if i % 2 else 0x200, reqid=i) for i in range(40)]
    outcome, raw = await run_stream(ctx_for(tl, pipelined(32, "uniform-lsn")), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    assert all(len({r.lsn for r in call}) == 1 for call in tl.get_pages_calls)
    assert decode_all(raw, requests, 3) == [GetPageResponse(r, expected_page(tl, r)) for r in requests]


async def test_scattered_lsn_mixes_lsns_but_not_per_page(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    # LSNs alternate request by request; every 16 requests a block comes back at the other LSN
    requests = [gp(i % 16, lsn=MAX if (i + i // 16) % 2 else 0x200, reqid=i) for i in range(64)]
    outcome, raw = await run_stream(ctx_for(tl, pipelined(32, "scattered-lsn")), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    assert any(len({r.lsn for r in call}) > 1 for call in tl.get_pages_calls)
    for call in tl.get_pages_calls:
        seen: dict[tuple[RelTag, int], Lsn] = {}
        for r in call:
            assert seen.setdefault((r.rel, r.blkno), r.lsn) == r.lsn
    assert decode_all(raw, requests, 3) == [GetPageResponse(r, expected_page(tl, r)) for r in requests]


async def test_same_page_same_lsn_folds(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    requests = [gp(3, reqid=i) for i in range(10)]
    outcome, _ = await run_stream(ctx_for(tl, pipelined(32, "scattered-lsn")), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    assert max(len(c) for c in tl.get_pages_calls) > 1


async def test_waiting_request_does_not_hold_back_folded_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """neon#9379: requests folded before one that must wait for WAL are answered first."""
    tl = make_timeline(read_delay_s=0.001)
    tl.block_get_pages = True  # hold Execution on the first batch so the rest fold behind it
    ready = [gp(i, reqid=i) for i in range(5)]
    waiting = gp(7, lsn=MAX, nms=0x2000, reqid=99)  # not_modified_since ahead of last_record_lsn
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        config = attrs.evolve(pipelined(), wait_lsn_timeout_s=30.0)
        nursery.start_soon(serve_pagestream_bytes, server, ctx_for(tl, config))
        await client.send_all(frame_requests([*ready, waiting], 3))
        await trio.testing.wait_all_tasks_blocked()
        tl.block_get_pages = False
        # all five ready requests are answered although the sixth is still waiting for WAL
        raw = bytearray()
        with trio.fail_after(1):
            while len(raw) < 5 * (5 + 8234):
                raw += await client.receive_some()
        assert decode_all(bytes(raw), ready, 3) == [GetPageResponse(r, expected_page(tl, r)) for r in ready]
        assert all(r.blkno != 7 for call in tl.get_pages_calls for r in call)
        await trio.sleep(1)
        tl.put_page(REL, 7, 0x2000)
        tl.advance(0x2000)
        with trio.fail_after(1):
            data = bytes(await client.receive_some())
            while len(data) < 5 + 8234:
                data += bytes(await client.receive_some())
        assert decode_all(data, [waiting], 3) == [GetPageResponse(waiting, page_image(REL, 7, 0x2000))]
        await client.send_eof()


async def test_lsn_wait_timeout_fails_the_whole_batch(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    requests = [gp(1, nms=0x5000, reqid=1), gp(2, nms=0x5000, reqid=2)]
    outcome, raw = await run_stream(ctx_for(tl), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    responses = decode_all(raw, requests, 3)
    assert all(isinstance(r, ErrorResponse) and r.message.startswith("LSN timeout") for r in responses)


# ---------------------------------------------------------------------------------------------
# Per-request results


async def test_all_request_types_and_errors(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    fsm = RelTag(1663, 5, 16384, 1)
    requests: list[Request] = [
        ExistsRequest(1, MAX, Lsn(OLD), REL),
        ExistsRequest(2, Lsn(0x50), Lsn(0x50), REL),  # before creation
        NblocksRequest(3, MAX, Lsn(OLD), REL),
        NblocksRequest(4, MAX, Lsn(OLD), fsm),  # missing FSM fork: 0
        NblocksRequest(5, MAX, Lsn(OLD), RelTag(1663, 5, 99999, 0)),  # missing main: Not found
        DbSizeRequest(6, MAX, Lsn(OLD), 5),
        GetSlruSegmentRequest(7, MAX, Lsn(OLD), SlruKind.CLOG, 0),
        GetSlruSegmentRequest(8, MAX, Lsn(OLD), SlruKind.CLOG, 1),
        gp(100, reqid=9),  # beyond the size: zeros
        gp(1, rel=RelTag(1663, 5, 0, 0), reqid=10),  # relnode 0
        gp(1, lsn=0, nms=0, reqid=11),  # LSN 0
        gp(1, lsn=0x100, nms=0x200, reqid=12),  # request_lsn < not_modified_since
        gp(1, rel=RelTag(1663, 5, 666, 0), reqid=13),  # reconstruction fails
        gp(1, rel=RelTag(1663, 5, 16384, 9), reqid=14),  # bad fork
    ]
    outcome, raw = await run_stream(ctx_for(tl), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    r = decode_all(raw, requests, 3)
    assert r[0] == ExistsResponse(requests[0], True)  # type: ignore[arg-type]
    assert r[1] == ExistsResponse(requests[1], False)  # type: ignore[arg-type]
    assert r[2] == NblocksResponse(requests[2], 16)  # type: ignore[arg-type]
    assert r[3] == NblocksResponse(requests[3], 0)  # type: ignore[arg-type]
    assert isinstance(r[4], ErrorResponse) and r[4].message.startswith("Not found")
    assert r[5] == DbSizeResponse(requests[5], (16 + 4 + 1) * BLCKSZ)  # type: ignore[arg-type]
    assert r[6] == GetSlruSegmentResponse(requests[6], slru_segment(7))  # type: ignore[arg-type]
    assert isinstance(r[7], ErrorResponse) and r[7].message.startswith("Not found")
    assert r[8] == GetPageResponse(requests[8], ZERO_PAGE)  # type: ignore[arg-type]
    for i, text in [(9, "invalid relnode"), (10, "invalid LSN(0)"), (11, "not_modified_since"), (13, "fork")]:
        err = r[i]
        assert isinstance(err, ErrorResponse), err
        assert err.message.startswith("Bad request") and text in err.message
    assert isinstance(r[12], ErrorResponse) and r[12].message.startswith("Read error")


async def test_gc_cutoff_is_a_bad_request(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    tl._gc_cutoff = Lsn(0x400)
    requests = [gp(1, lsn=0x300, nms=0x100), gp(1, lsn=0x500, nms=0x100)]
    _, raw = await run_stream(ctx_for(tl), [frame_requests(requests, 3)])
    r = decode_all(raw, requests, 3)
    assert isinstance(r[0], ErrorResponse) and "garbage collected" in r[0].message
    assert r[1] == GetPageResponse(requests[1], expected_page(tl, requests[1]))


# ---------------------------------------------------------------------------------------------
# The serial handler is the oracle


rels = st.sampled_from(
    [REL, REL2, RelTag(1663, 5, 16384, 1), RelTag(1663, 5, 0, 0), RelTag(1663, 5, 666, 0), RelTag(1663, 5, 424242, 0)]
)
lsns = st.sampled_from([MAX, 0, 0x100, 0x200, 0x800, 0x1000, 0x3000])


@st.composite
def request_lists(draw: st.DrawFn, version: int) -> list[Request]:
    out: list[Request] = []
    for i in range(draw(st.integers(0, 40))):
        reqid = i if version == 3 else 0
        lsn, nms = Lsn(draw(lsns)), Lsn(draw(lsns))
        kind = draw(st.integers(0, 9))
        if kind <= 5:
            out.append(GetPageRequest(reqid, lsn, nms, draw(rels), draw(st.integers(0, 20))))
        elif kind == 6:
            out.append(ExistsRequest(reqid, lsn, nms, draw(rels)))
        elif kind == 7:
            out.append(NblocksRequest(reqid, lsn, nms, draw(rels)))
        elif kind == 8:
            out.append(DbSizeRequest(reqid, lsn, nms, draw(st.sampled_from([5, 6]))))
        else:
            out.append(GetSlruSegmentRequest(reqid, lsn, nms, SlruKind.CLOG, draw(st.integers(0, 1))))
    return out


def _segment(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    return [raw[a:b] for a, b in itertools.pairwise(points) if b > a]


async def _serve_both(
    version: PagestreamVersion, chunks: list[bytes], config: PageServiceConfig, delay: float
) -> tuple[tuple[str, str], bytes]:
    tl = make_timeline(read_delay_s=delay)
    outcome, raw = await run_stream(ctx_for(tl, config, version=version), chunks)
    kind = (
        (type(outcome).__name__, getattr(outcome, "sqlstate", ""))
        if isinstance(outcome, BaseException)
        else ("end", str(outcome))
    )
    return kind, raw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from([2, 3]),
    data=st.data(),
    cuts=st.lists(st.integers(0, 10**6), max_size=12),
    tail=st.sampled_from([b"", b"d\0\0\0\5\x09", b"d\0\0\0\x07\x02ab", b"Q\0\0\0\5x", b"c\0\0\0\4"]),
    max_batch_size=st.sampled_from([1, 4, 32]),
    batching=st.sampled_from(["uniform-lsn", "scattered-lsn"]),
    delay=st.sampled_from([0.0, 0.001]),
)
def test_pipelined_output_equals_serial_output(
    version: PagestreamVersion,
    data: st.DataObject,
    cuts: list[int],
    tail: bytes,
    max_batch_size: int,
    batching: str,
    delay: float,
) -> None:
    requests = data.draw(request_lists(version))
    raw = frame_requests(requests, version) + tail
    chunks = _segment(raw, cuts)

    async def main() -> None:
        serial = await _serve_both(version, chunks, SERIAL, delay)
        piped = await _serve_both(version, chunks, pipelined(max_batch_size, batching), delay)
        assert piped == serial
        if not tail:
            assert serial[0] == ("end", str(StreamEnd.TERMINATE))
            assert len(decode_all(serial[1], requests, version)) == len(requests)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# ---------------------------------------------------------------------------------------------
# Errors in each stage, shutdown, hostile input


@pytest.mark.parametrize("config", [SERIAL, pipelined()], ids=["serial", "pipelined"])
async def test_reading_error_answers_earlier_requests_first(
    autojump_clock: trio.testing.MockClock, config: PageServiceConfig
) -> None:
    tl = make_timeline(read_delay_s=0.001)
    requests = [gp(i, reqid=i) for i in range(6)]
    raw = frame_requests(requests, 3) + b"d\0\0\0\5\x2a" + frame_requests([gp(9)], 3)
    outcome, out = await run_stream(ctx_for(tl, config), [raw], eof=False)
    assert isinstance(outcome, RemoteProtocolError) and "invalid tag 42" in str(outcome)
    assert outcome.sqlstate == "XX000"
    assert decode_all(out, requests, 3) == [GetPageResponse(r, expected_page(tl, r)) for r in requests]


async def test_truncated_stream_is_an_error(autojump_clock: trio.testing.MockClock) -> None:
    requests = [gp(1, reqid=1)]
    raw = frame_requests(requests, 3)
    outcome, out = await run_stream(ctx_for(), [raw + raw[:10]])
    assert isinstance(outcome, RemoteProtocolError) and "middle of a message" in str(outcome)
    assert len(decode_all(out, requests, 3)) == 1


class ExplodingResolver:
    def __init__(self, reader: PageReader, after: int, error: Exception) -> None:
        self.reader, self.after, self.error, self.n = reader, after, error, 0

    def resolve(self, request: Request) -> PageReader:
        self.n += 1
        if self.n > self.after:
            raise self.error
        return self.reader


async def test_batching_stage_error_tears_down(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    resolver = ExplodingResolver(tl, 3, RuntimeError("resolver bug"))
    requests = [gp(i, reqid=i) for i in range(6)]
    outcome, _ = await run_stream(ctx_for(resolver=resolver), [frame_requests(requests, 3)], eof=False)
    assert isinstance(outcome, RuntimeError) and str(outcome) == "resolver bug"


async def test_misrouted_getpage_is_reconnect(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    resolver = ExplodingResolver(tl, 2, NotFound("no such tenant shard"))
    requests = [gp(i, reqid=i) for i in range(4)]
    outcome, out = await run_stream(ctx_for(resolver=resolver), [frame_requests(requests, 3)], eof=False)
    assert isinstance(outcome, Reconnect) and outcome.sqlstate == "08006"
    assert len(decode_all(out, requests, 3)) == 2  # the two before it were answered


async def test_many_misrouted_getpages_end_with_one_reconnect(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Batching is still folding the misrouted requests behind the first one when Execution
    # raises it: finding Execution gone must not turn the Reconnect into an exception group.
    tl = make_timeline()
    resolver = ExplodingResolver(tl, 2, NotFound("no such tenant shard"))
    requests = [gp(i, reqid=i) for i in range(8)]
    outcome, out = await run_stream(ctx_for(resolver=resolver), [frame_requests(requests, 3)], eof=False)
    assert isinstance(outcome, Reconnect), repr(outcome)
    assert len(decode_all(out, requests, 3)) == 2


async def test_client_gone_mid_batch_is_one_error(autojump_clock: trio.testing.MockClock) -> None:
    # Execution's send fails while Batching is parked on a full batch behind it.
    tl = make_timeline(read_delay_s=1.0)
    client, server = trio.testing.memory_stream_pair()
    outcome: BaseException | None = None

    async def serve() -> None:
        nonlocal outcome
        try:
            await serve_pagestream_bytes(server, ctx_for(tl, pipelined(max_batch_size=2)))
        except Exception as exc:  # an exception group included: the test checks exactly this
            outcome = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        await client.send_all(frame_requests([gp(i, reqid=i) for i in range(10)], 3))
        await trio.sleep(0.5)
        await client.aclose()
    assert isinstance(outcome, trio.BrokenResourceError), repr(outcome)
    assert pagestream_tasks() == []


async def test_execution_error_cancels_parked_reader(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline()
    tl.fail_get_pages = OSError("disk on fire")
    outcome, _ = await run_stream(ctx_for(tl), [frame_requests([gp(1)], 3)], eof=False)
    assert isinstance(outcome, OSError) and "disk on fire" in str(outcome)


async def test_client_eof_and_copydone_end_cleanly(autojump_clock: trio.testing.MockClock) -> None:
    requests = [gp(1, reqid=1), gp(2, reqid=2)]
    outcome, out = await run_stream(ctx_for(), [frame_requests(requests, 3) + b"c\0\0\0\4"], eof=False)
    assert outcome is StreamEnd.COPY_DONE
    assert len(decode_all(out, requests, 3)) == 2
    outcome, _ = await run_stream(ctx_for(), [frame_requests(requests, 3) + b"X\0\0\0\4"], eof=False)
    assert outcome is StreamEnd.TERMINATE


@pytest.mark.parametrize("config", [SERIAL, pipelined()], ids=["serial", "pipelined"])
async def test_timeline_shutdown_ends_stream_with_57p01(
    autojump_clock: trio.testing.MockClock, config: PageServiceConfig
) -> None:
    tl = make_timeline(read_delay_s=10.0)  # requests sit in Execution and in the batcher
    ctx = ctx_for(tl, config, shutdown=tl.wait_shutdown)
    client, server = trio.testing.memory_stream_pair()
    outcome: BaseException | None = None

    async def serve() -> None:
        nonlocal outcome
        try:
            await serve_pagestream_bytes(server, ctx)
        except Shutdown as exc:
            outcome = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        await client.send_all(frame_requests([gp(i) for i in range(10)], 3))
        await trio.sleep(1)
        assert pagestream_tasks() or isinstance(config.page_service_pipelining, SerialPipelining)
        start = trio.current_time()
        tl.shut_down()
    assert trio.current_time() - start < 0.1  # released promptly, not after the 10 s read
    assert isinstance(outcome, Shutdown) and outcome.sqlstate == "57P01"
    assert pagestream_tasks() == []


async def test_outer_cancellation_stops_all_stages(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=10.0)
    client, server = trio.testing.memory_stream_pair()
    with trio.move_on_after(1) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_pagestream_bytes, server, ctx_for(tl))
            await client.send_all(frame_requests([gp(i) for i in range(10)], 3))
            await trio.sleep(5)
    assert scope.cancelled_caught
    assert pagestream_tasks() == []


@settings(max_examples=30, deadline=None)
@given(garbage=st.binary(max_size=120), version=st.sampled_from([2, 3]))
def test_hostile_bytes(garbage: bytes, version: PagestreamVersion) -> None:
    async def main() -> None:
        outcome, _ = await run_stream(ctx_for(version=version), [garbage])
        assert isinstance(outcome, StreamEnd | RemoteProtocolError), outcome

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_backpressure_reaches_the_transport(autojump_clock: trio.testing.MockClock) -> None:
    """With Execution stuck, Reading stops reading: the client's send cannot complete."""
    tl = make_timeline()
    tl.block_get_pages = True
    client, server = trio.testing.lockstep_stream_pair()  # send_all waits for receive_some
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_pagestream_bytes, server, ctx_for(tl, pipelined(4)))
        requests = [NblocksRequest(i, MAX, Lsn(OLD), REL) for i in range(20000)]
        with trio.move_on_after(5) as scope:
            await client.send_all(frame_requests([gp(0), *requests], 3))
        assert scope.cancelled_caught  # ~860 KB could not be pushed into a stalled pipeline
        nursery.cancel_scope.cancel()
    assert pagestream_tasks() == []


async def test_metrics(autojump_clock: trio.testing.MockClock) -> None:
    tl = make_timeline(read_delay_s=0.001)
    registry = CollectorRegistry()
    metrics = PageServiceMetrics.register(registry)
    requests: list[Request] = [gp(i % 16, reqid=i) for i in range(64)]
    requests.append(gp(1, rel=RelTag(1663, 5, 0, 0)))
    requests.append(NblocksRequest(0, MAX, Lsn(OLD), REL))
    outcome, _ = await run_stream(ctx_for(tl, pipelined(16), metrics=metrics), [frame_requests(requests, 3)])
    assert outcome is StreamEnd.TERMINATE
    get = registry.get_sample_value
    assert get("pageserver_page_service_requests_total", {"type": "get_page", "outcome": "ok"}) == 64
    assert get("pageserver_page_service_requests_total", {"type": "get_page", "outcome": "error"}) == 1
    assert get("pageserver_page_service_requests_total", {"type": "nblocks", "outcome": "ok"}) == 1
    assert get("pageserver_page_service_batch_size_sum") == 66
    assert metrics.batching_factor() > 4
    assert get("pageserver_page_service_getpage_execution_seconds_count") == 65
    assert get("pageserver_page_service_time_in_batcher_seconds_count") == 66


# ---------------------------------------------------------------------------------------------
# Configuration


def test_pipelining_config_tagged_union() -> None:
    assert structure_config({}).page_service_pipelining == PipelinedPipelining(32, "scattered-lsn")
    serial = structure_config({"page_service_pipelining": {"mode": "serial"}})
    assert serial.page_service_pipelining == SerialPipelining()
    piped = structure_config({"page_service_pipelining": {"mode": "pipelined", "max_batch_size": 8}})
    # present without batching: neon's serde default, uniform-lsn
    assert piped.page_service_pipelining == PipelinedPipelining(8, "uniform-lsn")
    cases: list[tuple[dict[str, object], str]] = [
        ({"page_service_pipelining": {"mode": "pipelined", "max_batch_size": 64}}, "max_get_vectored_keys"),
        ({"page_service_pipelining": {"mode": "pipelined", "batching": "sideways"}}, "batching"),
        ({"page_service_pipelining": {"mode": "bogus"}}, "page_service"),
        ({"page_service_pipelining": {"mode": "serial", "extra": 1}}, "extra"),
        ({"wait_lsn_timeout_s": "soon"}, "wait_lsn_timeout_s"),
    ]
    for bad, word in cases:
        with pytest.raises(ValueError, match=word):
            structure_config(bad)


async def test_receiver_gone_behind_an_outer_cancel_is_still_a_cancel() -> None:
    """Execution cancelled from outside (57P01, the connection's scope) while Batching was
    runnable: Batching finds it gone (``ReceiverGone``) before its own checkpoint. That is the
    cancellation's consequence: the scope must absorb it, not see a BrokenResourceError."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            cancelled = exc
        async with _unwrapped():
            raise BaseExceptionGroup("pipeline", [cancelled, ReceiverGone("FoldChannel receiver is gone")])
    assert scope.cancelled_caught
