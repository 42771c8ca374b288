"""The WAL run pre-check (pageserver/wal_precheck.py): every claim holds (checked by a slow,
independent reference straight from the claim's definition), the claims are maximal on
well-formed WAL (against runs found from ``WalStreamDecoder``'s records), hostile bytes
never raise, and the child process answers like ``RunFinder`` in-process or fails loudly."""

from __future__ import annotations

import itertools
import os
import random
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pageserver.wal_precheck import WalPrecheck, WalPrecheckError
from pageserver.wal_runs import RING_SIZE, RunClaims, RunFinder, check_claims, find_runs
from protocol.lsn import XLOG_BLCKSZ
from protocol.wal import crc as _crcmod
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode
from protocol.wal.rmgr import RmgrId

SEG = 32 * 1024  # small segments: long headers and XLOG_SWITCH zero-fill come often
PAGE = XLOG_BLCKSZ
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


# -- WAL to test with ----------------------------------------------------------------------

# a group: (records, block data length, main data length, xid, block number, info); a
# group with records == 0 is an XLOG_SWITCH
Group = tuple[int, int, int, int, int, int]

groups_st = st.lists(
    st.one_of(
        st.tuples(
            st.integers(1, 40), st.sampled_from([0, 3, 17, 100, 104, 3000, 9000]), st.sampled_from([0, 3, 5]),
            st.sampled_from([0, 700, 701]), st.integers(0, 3), st.sampled_from([0x00, 0x80]),
        ),
        st.just((0, 0, 0, 0, 0, 0)),
    ),
    min_size=1,
    max_size=12,
)


def make_wal(groups: Sequence[Group], seed: int = 0) -> tuple[int, bytes]:
    """(start LSN, bytes): like records in groups (a group is a run when it fits a page),
    page crossings for the long ones, XLOG_SWITCHes; starts at a segment start."""
    rng = random.Random(seed)
    start = SEG
    enc = WalEncoder(start, segment_size=SEG)
    rnode = RelFileNode(1663, 5, 16384)
    for count, data_len, main_len, xid, blkno, info in groups:
        if count == 0:
            enc.switch()
            continue
        for _ in range(count):
            data = rng.randbytes(data_len)
            enc.append(
                RmgrId.HEAP, info, xid=xid, blocks=[BlockSpec(rnode, blkno, data=data)],
                main_data=rng.randbytes(main_len),
            )
    return start, enc.take()


def bulk_wal() -> tuple[int, bytes]:
    """A bulk load's shape: runs of 60 INSERTs into one heap block, page after page."""
    return make_wal([(60, 100, 3, 700, b, 0) for b in range(30)] + [(0, 0, 0, 0, 0, 0)] + [(45, 17, 3, 9, 1, 0)] * 3)


# -- the reference: the claim's definition, checked one record at a time ----------------------


def claim_problem(stream: bytes, stream_lsn: int, low: int, high: int, claim: tuple[int, int, int]) -> str | None:
    """Why ``claim`` does not hold for the bytes ``stream`` (WAL from ``stream_lsn``) that the
    finder had in [low, high), or None. Written from the definition, not from the finder."""
    start, last, stride = claim
    if stride <= 0 or last < start + stride or (last - start) % stride:
        return "malformed"
    n = (last - start) // stride + 1

    def rec(i: int, length: int) -> bytes:
        at = start + i * stride - stream_lsn
        return stream[at : at + length]

    tot = _U32.unpack(rec(0, 4))[0]
    if tot < 46:
        return f"tot_len {tot} < 46"
    if stride != (tot + 7) & ~7:
        return f"stride {stride} is not MAXALIGN({tot})"
    page = start // PAGE
    first = rec(0, tot)
    for i in range(n):
        lsn = start + i * stride
        if lsn < low or lsn + tot > high:
            return f"record {i} at {lsn:X} outside the bytes received [{low:X}, {high:X})"
        if lsn // PAGE != page or (lsn + tot - 1) // PAGE != page:
            return f"record {i} at {lsn:X} not inside the page of {start:X}"
        raw = rec(i, tot)
        if raw[0:8] != first[0:8] or raw[16:20] != first[16:20] or raw[24:46] != first[24:46]:
            return f"record {i} at {lsn:X} is not like R_0"
        if i and _U64.unpack(raw[8:16])[0] != lsn - stride:
            return f"record {i} at {lsn:X}: xl_prev is not the record before"
        crc = _crcmod.crc32c(raw[0:20], _crcmod.crc32c(raw[24:tot]))
        if crc != _U32.unpack(raw[20:24])[0]:
            return f"record {i} at {lsn:X}: bad CRC"
    return None


def assert_claims_hold(claims: RunClaims, stream: bytes, stream_lsn: int, low: int, high: int) -> None:
    assert check_claims(claims, low, high) is None
    triples = claims.triples()
    assert triples == sorted(triples)
    for a, b in itertools.pairwise(triples):
        assert a[1] < b[0], f"overlapping claims {a} {b}"
    for claim in triples:
        problem = claim_problem(stream, stream_lsn, low, high, claim)
        assert problem is None, f"claim {claim}: {problem}"


def decoded(stream: bytes, start: int) -> list[DecodedRecord]:
    dec = WalStreamDecoder(start, segment_size=SEG)
    dec.feed(stream)
    out: list[DecodedRecord] = []
    dec.decode_into(out)
    return out


def like_pairs(records: Sequence[DecodedRecord], received: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """(R, R') start LSNs of consecutive records that a claim must cover together: R' right
    after R, both inside one page and inside one contiguous received stretch that holds the
    page's header, alike, linked (decoded: CRCs right)."""
    for r, s in itertools.pairwise(records):
        tot = r.xl_tot_len
        page = r.lsn - r.lsn % PAGE
        if (
            tot >= 46
            and s.lsn == r.lsn + ((tot + 7) & ~7)
            and s.lsn + s.xl_tot_len <= page + PAGE
            and r.raw[0:8] == s.raw[0:8] and r.raw[16:20] == s.raw[16:20] and r.raw[24:46] == s.raw[24:46]
            and s.xl_prev == r.lsn
            and any(lo <= page and s.lsn + s.xl_tot_len <= hi for lo, hi in received)
        ):
            yield r.lsn, s.lsn


def covered(all_claims: Sequence[tuple[int, int, int]], a: int, b: int) -> bool:
    return any(start <= a and b <= last and (a - start) % stride == 0 for start, last, stride in all_claims)


def feed_pieces(stream: bytes, start: int, cuts: Sequence[int], drop: Sequence[bool]) -> tuple[
    list[tuple[int, int, RunClaims]], list[tuple[int, int]]
]:
    """Feed ``stream`` cut at ``cuts`` (dropping pieces where ``drop``) to one RunFinder;
    returns (low, high, claims) per piece fed and the contiguous stretches received; checks
    each answer's claims against the bytes that finder had."""
    bounds = sorted({0, len(stream), *(c for c in cuts if 0 < c < len(stream))})
    finder = RunFinder(SEG)
    answers = []
    stretches: list[tuple[int, int]] = []
    stretch_lo: int | None = None
    prev_end: int | None = None
    for (a, b), skip in zip(itertools.pairwise(bounds), [*drop, *[False] * len(bounds)], strict=False):
        if skip:
            continue
        base = start + a
        if base != prev_end:
            stretch_lo = base
        assert stretch_lo is not None
        low = finder.walked_from(base)
        claims = finder.feed(base, stream[a:b])
        assert low >= stretch_lo
        assert_claims_hold(claims, stream, start, low, start + b)
        answers.append((low, start + b, claims))
        if base == prev_end:
            stretches[-1] = (stretch_lo, start + b)
        else:
            stretches.append((stretch_lo, start + b))
        prev_end = start + b
    return answers, stretches


# -- find_runs / RunFinder ---------------------------------------------------------------------


def test_bulk_shape_claims_every_run() -> None:
    start, stream = bulk_wal()
    claims = find_runs(stream, start, SEG)
    assert_claims_hold(claims, stream, start, start, start + len(stream))
    records = decoded(stream, start)
    pairs = list(like_pairs(records, [(start, start + len(stream))]))
    assert len(pairs) > 1500
    triples = claims.triples()
    assert all(covered(triples, a, b) for a, b in pairs)
    # and nothing but those: each claim is a stretch of such pairs
    pair_set = set(pairs)
    for s0, last, stride in triples:
        for lsn in range(s0, last, stride):
            assert (lsn, lsn + stride) in pair_set


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=groups_st, seed=st.integers(0, 3), cuts=st.lists(st.integers(0, 200_000), max_size=12),
       gaps=st.lists(st.booleans(), max_size=12))
def test_pieces_claims_hold_and_are_maximal(groups: list[Group], seed: int, cuts: list[int], gaps: list[bool]) -> None:
    start, stream = make_wal(groups, seed)
    cuts = [c % (len(stream) + 1) for c in cuts]
    for drop in ([], gaps):  # contiguous, then with pieces missing
        answers, stretches = feed_pieces(stream, start, cuts, drop)
        all_claims = [t for _, _, c in answers for t in c.triples()]
        records = decoded(stream, start)
        for a, b in like_pairs(records, stretches):
            assert covered(all_claims, a, b), f"like records {a:X}, {b:X} not claimed together"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=groups_st, seed=st.integers(0, 3), cuts=st.lists(st.integers(0, 200_000), max_size=8),
       flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=4))
def test_corrupted_wal_claims_still_hold(groups: list[Group], seed: int, cuts: list[int],
                                         flips: list[tuple[int, int]]) -> None:
    start, clean = make_wal(groups, seed)
    stream = bytearray(clean)
    for at, x in flips:
        stream[at % len(stream)] ^= x
    feed_pieces(bytes(stream), start, [c % (len(stream) + 1) for c in cuts], [])


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=40_000), base=st.integers(0, (1 << 40)), cuts=st.lists(st.integers(0, 40_000), max_size=5))
def test_random_bytes_never_raise(data: bytes, base: int, cuts: list[int]) -> None:
    finder = RunFinder(SEG)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    for a, b in itertools.pairwise(bounds):
        low = finder.walked_from(base + a)
        claims = finder.feed(base + a, data[a:b])
        assert_claims_hold(claims, data, base, low, base + b)


def test_random_bytes_with_valid_page_headers() -> None:
    """Garbage records behind valid page headers: claims, if any, still hold."""
    rng = random.Random(7)
    start, clean = bulk_wal()
    for _ in range(30):
        stream = bytearray(clean[: 8 * PAGE])
        for page in range(8):
            at = page * PAGE + (40 if page == 0 else 24)
            body = rng.randbytes(PAGE - at % PAGE)
            if rng.random() < 0.5:
                # keep the record headers, garble the rest: plenty of runs fail late
                body = bytes(b if rng.random() > 0.02 else rng.randrange(256) for b in stream[at : at + len(body)])
            stream[at : at + len(body)] = body
        data = bytes(stream)
        assert_claims_hold(find_runs(data, start, SEG), data, start, start, start + len(data))


def test_every_single_byte_flip_on_a_page() -> None:
    """Exhaustive: each byte of a page with runs (and the page header, and a crossing record's
    tail) flipped in turn; every claim must still hold. Catches an unchecked CRC of R_0, a
    layout byte not compared, an xl_prev chain off by one..."""
    groups: list[Group] = [(4, 3000, 3, 5, 0, 0), (10, 100, 3, 700, 1, 0), (12, 100, 3, 700, 2, 0), (30, 17, 5, 700, 2, 0)]
    start, clean = make_wal(groups)
    page = 1  # starts with a long record's continuation, then the runs, then a crossing
    lo, hi = page * PAGE, (page + 1) * PAGE
    base_claims = find_runs(clean[lo:hi], start + lo, SEG)
    assert len(base_claims) >= 2 and base_claims.records() > 30
    for at in range(lo, hi):
        stream = bytearray(clean[lo:hi])
        stream[at - lo] ^= 0x01 if at % 3 else 0x80
        data = bytes(stream)
        claims = find_runs(data, start + lo, SEG)
        assert_claims_hold(claims, data, start + lo, start + lo, start + hi)


def test_every_cut_within_a_page() -> None:
    """Exhaustive: the bytes received end at each offset of a page with runs in turn (a piece
    cut anywhere); no claim may reach past the end, none is missed."""
    groups: list[Group] = [(4, 3000, 3, 5, 0, 0), (10, 100, 3, 700, 1, 0), (12, 100, 3, 700, 2, 0), (30, 17, 5, 700, 2, 0)]
    start, stream = make_wal(groups)
    records = decoded(stream, start)
    lo, hi = PAGE, 2 * PAGE
    for cut in range(lo, hi):
        claims = find_runs(stream[lo:cut], start + lo, SEG)
        assert_claims_hold(claims, stream, start, start + lo, start + cut)
        if cut % 61 == 0:  # (maximality: a sample, the reference is slow)
            triples = claims.triples()
            for a, b in like_pairs(records, [(start + lo, start + cut)]):
                assert covered(triples, a, b)


def test_crc_of_first_record_checked() -> None:
    start, clean = make_wal([(10, 100, 3, 700, 1, 0)])
    first = find_runs(clean, start, SEG).triples()
    assert first == [(start + 40, start + 40 + 9 * 152, 152)]
    stream = bytearray(clean)
    stream[40 + 100] ^= 0xFF  # R_0's block data
    assert find_runs(bytes(stream), start, SEG).triples() == [(start + 40 + 152, start + 40 + 9 * 152, 152)]
    stream = bytearray(clean)
    stream[40 + 4 * 152 + 100] ^= 0xFF  # R_4's: the run splits around it
    assert find_runs(bytes(stream), start, SEG).triples() == [
        (start + 40, start + 40 + 3 * 152, 152), (start + 40 + 5 * 152, start + 40 + 9 * 152, 152)
    ]


def _fix_crc(stream: bytearray, at: int) -> None:
    tot = _U32.unpack_from(stream, at)[0]
    raw = bytes(stream[at : at + tot])
    _U32.pack_into(stream, at + 20, _crcmod.crc32c(raw[0:20], _crcmod.crc32c(raw[24:tot])))


def test_wrong_xl_prev_with_a_right_crc_is_not_claimed() -> None:
    start, clean = make_wal([(10, 100, 3, 700, 1, 0)])
    at = 40 + 5 * 152  # R_5
    for delta in (8, -8, 152, -152, 1 << 32):
        stream = bytearray(clean)
        _U64.pack_into(stream, at + 8, _U64.unpack_from(stream, at + 8)[0] + delta)
        _fix_crc(stream, at)
        data = bytes(stream)
        claims = find_runs(data, start, SEG)
        assert_claims_hold(claims, data, start, start, start + len(data))
        # R_5 starts a run of its own (nothing is claimed about a run's first xl_prev)
        assert claims.triples() == [(start + 40, start + 40 + 4 * 152, 152), (start + at, start + 40 + 9 * 152, 152)]


@pytest.mark.parametrize("field", ["xid", "info", "rmid", "pad", "blkno", "rel", "byte44", "byte45", "len"])
def test_nearly_alike_records_are_not_claimed_together(field: str) -> None:
    """Valid WAL (CRCs right) where R_3 differs from R_0..R_2 in one compared byte only."""
    rng = random.Random(3)
    start = SEG
    enc = WalEncoder(start, segment_size=SEG)
    rnode = RelFileNode(1663, 5, 16384)
    for i in range(6):
        odd = i == 3
        data = bytes([1, 2]) + rng.randbytes(60)
        if odd and field in ("byte44", "byte45"):
            data = bytes([1 if field == "byte45" else 9, 9 if field == "byte45" else 2]) + data[2:]
        enc.append(
            RmgrId.HEAP2 if odd and field == "rmid" else RmgrId.HEAP,
            0x10 if odd and field == "info" else 0,
            xid=8 if odd and field == "xid" else 7,
            blocks=[BlockSpec(RelFileNode(1663, 5, 99) if odd and field == "rel" else rnode,
                              5 if odd and field == "blkno" else 4, data=data + (b"x" if odd and field == "len" else b""))],
        )
    stream = bytearray(enc.take())
    rec3 = 40 + 3 * 112  # records of 24 + 20 + 62 = 106 bytes, stride 112
    if field == "pad":
        stream[rec3 + 18] = 1
        _fix_crc(stream, rec3)
    data = bytes(stream)
    claims = find_runs(data, start, SEG)
    assert_claims_hold(claims, data, start, start, start + len(data))
    assert claims.triples()[0] == (start + 40, start + 40 + 2 * 112, 112)


def test_mid_page_start_without_carry_skips_that_page() -> None:
    start, stream = bulk_wal()
    finder = RunFinder(SEG)
    claims = finder.feed(start + 100, stream[100 : 3 * PAGE])
    assert claims.starts and min(claims.starts) >= start + PAGE
    # a contiguous piece then carries the incomplete page: claims there may repeat
    more = finder.feed(start + 3 * PAGE, stream[3 * PAGE : 5 * PAGE])
    assert finder.walked_from(start + 5 * PAGE) == start + 5 * PAGE
    assert_claims_hold(more, stream, start, start + 3 * PAGE, start + 5 * PAGE)


def test_a_piece_that_does_not_continue_drops_the_carry() -> None:
    start, stream = bulk_wal()
    for second in (3 * PAGE + 100, 2 * PAGE, PAGE + 5000 - 800, 0):  # later, aligned, overlapping, restart
        finder = RunFinder(SEG)
        finder.feed(start, stream[: PAGE + 5000])
        assert finder.walked_from(start + PAGE + 5000) == start + PAGE
        assert finder.walked_from(start + second) == start + second
        claims = finder.feed(start + second, stream[second : 5 * PAGE])
        assert_claims_hold(claims, stream, start, start + second, start + 5 * PAGE)
        assert claims.triples() == RunFinder(SEG).feed(start + second, stream[second : 5 * PAGE]).triples()


def test_segment_size_validated() -> None:
    with pytest.raises(ValueError):
        RunFinder(12345)


# -- the child process --------------------------------------------------------------------------


def pieces_of(stream: bytes, start: int, size: int = 20_000) -> list[tuple[int, bytes]]:
    return [(start + at, stream[at : at + size]) for at in range(0, len(stream), size)]


def live(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(") ")[1][0] != "Z"


@pytest.mark.parametrize("ring_size", [RING_SIZE, 50_000, 0])
async def test_child_answers_like_runfinder(ring_size: int) -> None:
    """Through the shared ring, through a small one (it wraps, and pieces that do not fit go
    on the pipe), without one."""
    start, stream = bulk_wal()
    pieces = pieces_of(stream, start)
    finder = RunFinder(SEG)
    want = [finder.feed(base, data).triples() for base, data in pieces]
    handle = WalPrecheck(segment_size=SEG, ring_size=ring_size)
    got: list[list[tuple[int, int, int]]] = []
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            for base, data in pieces:
                while handle.pending >= 4:
                    await trio.sleep(0.001)
                await handle.submit(base, data)

        nursery.start_soon(send)
        for _ in pieces:
            while not handle.pending:
                await trio.sleep(0.001)
            got.append((await handle.result()).triples())
    assert got == want
    assert sum(map(len, got)) > 30
    if ring_size == RING_SIZE:
        assert handle.inline == 0
    elif ring_size == 0:
        assert handle.inline == len(pieces)
    else:
        assert 0 < handle.inline < len(pieces)
    pid = handle.pid
    assert live(pid)
    await handle.aclose()
    assert not live(pid)
    with pytest.raises(WalPrecheckError, match="closed"):
        await handle.submit(start, b"")


async def test_killed_child_fails_the_pending_result() -> None:
    start, stream = bulk_wal()
    handle = WalPrecheck(segment_size=SEG, worker_args=["--stall-s", "5"])
    await handle.submit(start, stream[:20000])
    pid = handle.pid
    assert pid is not None
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def kill_soon() -> None:
                await trio.sleep(0.3)
                os.kill(pid, 9)

            nursery.start_soon(kill_soon)
            with pytest.raises(WalPrecheckError, match="closed its answer pipe"):
                await handle.result()
    assert not live(pid)
    with pytest.raises(WalPrecheckError, match="broken"):
        await handle.submit(start, stream[:100])
    await handle.aclose()


@pytest.mark.parametrize(("flag", "match"), [
    ("--garble", "garbled answer"),
    ("--misanswer", "answer for the piece"),
    ("--bad-claim", "bad stride"),
])
async def test_bad_answers_break_the_handle(flag: str, match: str) -> None:
    start, stream = bulk_wal()
    handle = WalPrecheck(segment_size=SEG, worker_args=[flag, "2"])
    for base, data in pieces_of(stream, start)[:3]:
        await handle.submit(base, data)
    assert (await handle.result()).starts  # the first answer is fine
    pid = handle.pid
    with pytest.raises(WalPrecheckError, match=match):
        await handle.result()
    assert handle.pending == 0 and not live(pid)
    with pytest.raises(WalPrecheckError):
        await handle.result()
    await handle.aclose()


async def test_child_that_dies_breaks_submit_or_result() -> None:
    start, stream = bulk_wal()
    handle = WalPrecheck(segment_size=SEG, worker_args=["--die-after", "1"])
    await handle.submit(start, stream[:20000])
    assert (await handle.result()).starts
    with trio.fail_after(10):
        with pytest.raises(WalPrecheckError):
            await handle.submit(start + 20000, stream[20000:40000])
            await handle.result()
    await handle.aclose()


async def test_crc_of_the_data_is_compared() -> None:
    """The answer's CRC is of the bytes the child got: a mismatch is a broken handle (here
    forced by changing the bytes after submit through the pending record)."""
    start, stream = bulk_wal()
    handle = WalPrecheck(segment_size=SEG)
    await handle.submit(start, stream[:20000])
    handle._pending[0].crc ^= 1
    with pytest.raises(WalPrecheckError, match="answer for the piece"):
        await handle.result()
    await handle.aclose()


async def test_cancelled_result_keeps_the_stream_in_step() -> None:
    start, stream = bulk_wal()
    pieces = pieces_of(stream, start)[:3]
    finder = RunFinder(SEG)
    want = [finder.feed(base, data).triples() for base, data in pieces]
    handle = WalPrecheck(segment_size=SEG, worker_args=["--stall-s", "0.3"])
    for base, data in pieces:
        await handle.submit(base, data)
    with trio.move_on_after(0.1):
        await handle.result()  # cancelled while waiting for the first answer
    assert handle.pending == 3 and handle.broken is None
    # cancelled in the middle of an answer: a half-read frame stays buffered
    await trio.sleep(0.5)
    assert handle._proc is not None and handle._proc.stdout is not None
    handle._inbuf += await handle._proc.stdout.receive_some(10)
    got = [(await handle.result()).triples() for _ in pieces]
    assert got == want
    await handle.aclose()


async def test_cancelled_submit_mid_write_breaks_the_handle() -> None:
    start, stream = bulk_wal()
    handle = WalPrecheck(segment_size=SEG, worker_args=["--stall-s", "5"])
    await handle.submit(start, stream[:1000])
    pid = handle.pid
    big = bytes(4 << 20)  # more than the pipe holds: the write must wait, then is cancelled
    with trio.move_on_after(0.5):
        await handle.submit(start + 1000, big)
    assert handle.broken is not None and "cancelled" in handle.broken
    assert not live(pid)
    with pytest.raises(WalPrecheckError):
        await handle.result()
    await handle.aclose()


def test_child_ends_when_its_parent_dies() -> None:
    """A pageserver killed without aclose: the watchdog ends the child (stdin EOF might never
    come if another process held the pipe)."""
    import subprocess
    import sys
    import time

    code = (
        "import os, sys, trio\n"
        "from pageserver.wal_precheck import WalPrecheck\n"
        "async def main():\n"
        "    h = WalPrecheck(worker_args=['--stall-s', '30'])\n"
        "    await h.submit(0, bytes(100))\n"
        "    await trio.sleep(0.7)\n"  # (the child is up, stalled, not reading its stdin)
        "    print(h.pid, flush=True)\n"
        "    os._exit(0)\n"
        "trio.run(main)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root, timeout=30)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 5
    while live(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(pid)
