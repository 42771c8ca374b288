"""The wire kernels: compiled (protocol/_pq_c.pyx) against the pure-Python twin.

``coalesce_appends`` must give the same outcome in both (result, or the same error class) on
well-formed runs, on runs broken anywhere (gaps, other terms or generations, truncated or
mutated messages) and on random bytes; and a coalesced run must say exactly what its messages
say one by one (the fold the acceptor does: first begin, last end, maximal commit and
truncate, the WAL concatenated).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import _pq_py
from protocol.append_runs import decode_append_run
from protocol.lsn import Lsn
from protocol.safekeeper import (
    MAX_SEND_SIZE,
    TAG_APPEND,
    V3_APPEND_HEADER_SIZE,
    AppendRequest,
    decode_proposer_message,
    encode_message,
)
from tests.conftest import kernel

PQ = "protocol._pq_c"


def _outcome(fn: object, *args: object) -> tuple[object, ...]:
    try:
        return ("ok", fn(*args))  # type: ignore[operator]
    except Exception as exc:
        return ("err", type(exc).__name__)


def _appends(sizes: list[int], start: int = 0x1000000, term: int = 3, gen: int = 1) -> list[bytes]:
    out = []
    at = start
    for k, size in enumerate(sizes):
        wal = bytes((at + i) & 0xFF for i in range(size))
        out.append(encode_message(AppendRequest(term, Lsn(at), Lsn(at + size), Lsn(at + k), Lsn(at // 2), wal, generation=gen), 3))
        at += size
    return out


@pytest.fixture(scope="module")
def both() -> tuple[ModuleType, ModuleType]:
    return kernel("native", PQ), kernel("python", PQ)


def test_twin_constants_are_the_protocol_s() -> None:
    assert _pq_py.TAG_APPEND == TAG_APPEND
    assert _pq_py.V3_APPEND_HEADER.size == V3_APPEND_HEADER_SIZE
    assert _pq_py.MAX_SEND_SIZE == MAX_SEND_SIZE


def test_a_run_says_what_its_messages_say(impl: str) -> None:
    coalesce = kernel(impl, PQ).coalesce_appends
    payloads = _appends([100, 0, 1000, 8])
    count, term, gen, begin, end, commit, trunc, wal = coalesce(payloads, 0, 1 << 20)
    singles = [decode_proposer_message(p, 3) for p in payloads]
    assert all(isinstance(m, AppendRequest) for m in singles)
    assert count == 4
    assert (term, gen) == (singles[0].term, singles[0].generation)  # type: ignore[union-attr]
    assert begin == singles[0].begin_lsn and end == singles[-1].end_lsn  # type: ignore[union-attr]
    assert commit == max(m.commit_lsn for m in singles)  # type: ignore[union-attr]
    assert trunc == max(m.truncate_lsn for m in singles)  # type: ignore[union-attr]
    assert wal == b"".join(bytes(m.wal) for m in singles)  # type: ignore[union-attr]


def test_runs_stop_at_a_gap_another_term_generation_or_message(impl: str) -> None:
    coalesce = kernel(impl, PQ).coalesce_appends
    a = _appends([10, 10])
    gap = _appends([10], start=0x1000000 + 21)
    other_term = _appends([10], start=0x1000000 + 20, term=4)
    other_gen = _appends([10], start=0x1000000 + 20, gen=2)
    for tail in (gap, other_term, other_gen, [b"gnot an append"]):
        assert coalesce(a + tail, 0, 1 << 20)[0] == 2
    assert coalesce(a, 1, 1 << 20)[0] == 0  # one message alone: nothing to coalesce
    assert coalesce(a, 2, 1 << 20)[0] == 0
    assert coalesce(_appends([10, 10, 10]), 0, 25)[0] == 2  # max_bytes counts the whole run
    assert coalesce(_appends([10, 10, 10]), 0, 0)[0] == 0


@pytest.mark.parametrize(("k", "max_bytes", "error"), [(-1, 10, IndexError), (3, 10, IndexError), (0, -1, ValueError)])
def test_bad_arguments(impl: str, k: int, max_bytes: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        kernel(impl, PQ).coalesce_appends(_appends([10, 10]), k, max_bytes)


def test_malformed_messages_are_left_to_the_decoder(impl: str) -> None:
    coalesce = kernel(impl, PQ).coalesce_appends
    good = _appends([10, 10, 10])
    truncated = good[1][:-1]  # the WAL is not all there
    assert coalesce([good[0], truncated, good[2]], 0, 1 << 20)[0] == 0
    lying = bytearray(good[1])
    lying[21:29] = (0).to_bytes(8, "big")  # end before begin
    assert coalesce([good[0], bytes(lying)], 0, 1 << 20)[0] == 0


def test_decode_append_run_counts_its_messages() -> None:
    run = decode_append_run(_appends([10, 20, 30]), 0, 1 << 20)
    assert run is not None and run.messages == 3 and len(run.wal) == 60
    assert decode_append_run(_appends([10]), 0, 1 << 20) is None


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
    flips=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 3100), st.integers(1, 255)), max_size=3),
    cuts=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 3100)), max_size=2),
    k=st.integers(0, 12),
    max_bytes=st.integers(0, 40000),
    as_views=st.booleans(),
)
@pytest.mark.native
def test_native_equals_twin_on_broken_runs(
    both: tuple[ModuleType, ModuleType], sizes: list[int], flips: list[tuple[int, int, int]],
    cuts: list[tuple[int, int]], k: int, max_bytes: int, as_views: bool,
) -> None:
    c, py = both
    payloads = [bytearray(p) for p in _appends(sizes)]
    for which, at, mask in flips:
        p = payloads[which % len(payloads)]
        p[at % len(p)] ^= mask
    for which, at in cuts:
        p = payloads[which % len(payloads)]
        del p[at % (len(p) + 1):]
    msgs: list[object] = [memoryview(p) if as_views else bytes(p) for p in payloads]
    k = k % (len(msgs) + 1)
    assert _outcome(c.coalesce_appends, msgs, k, max_bytes) == _outcome(py.coalesce_appends, msgs, k, max_bytes)


@settings(max_examples=200, deadline=None)
@given(msgs=st.lists(st.binary(max_size=200).map(lambda b: b"a" + b), max_size=6), k=st.integers(0, 6))
@pytest.mark.native
def test_native_equals_twin_on_random_bytes(both: tuple[ModuleType, ModuleType], msgs: list[bytes], k: int) -> None:
    c, py = both
    k = k % (len(msgs) + 1)
    assert _outcome(c.coalesce_appends, msgs, k, 1 << 20) == _outcome(py.coalesce_appends, msgs, k, 1 << 20)


@pytest.mark.native
def test_non_buffers_are_the_same_error(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    for payloads in (["text", b"x"], [memoryview(b"a" * 100)[::2], b"x"], [None]):
        assert _outcome(c.coalesce_appends, payloads, 0, 10) == _outcome(py.coalesce_appends, payloads, 0, 10)


# --- take_frames (PostgreSQL framing, zero copy) ----------------------------------------------


def _frames(bodies: list[bytes], tag: bytes = b"d") -> bytes:
    return b"".join(tag + (4 + len(b)).to_bytes(4, "big") + b for b in bodies)


def test_take_frames_cuts_complete_messages_as_views(impl: str) -> None:
    take = kernel(impl, PQ).take_frames
    data = bytearray(b"xx" + _frames([b"abc", b"", b"y" * 100]) + _frames([b"q"], b"Q"))
    out, stop = take(data, 2, len(data), ord("d"), 1 << 20, 100)
    assert [bytes(v) for v in out] == [b"abc", b"", b"y" * 100]
    assert stop == 2 + 8 + 5 + 105
    assert all(v.obj is out[0].obj for v in out)  # one export shared by the batch
    assert take(data, 2, len(data), ord("d"), 1 << 20, 2)[1] == 2 + 8 + 5  # limit
    assert take(data, 2, len(data), ord("d"), 50, 100)[1] == 2 + 8 + 5  # max_length
    assert take(data, 2, len(data) - 1 - 6, ord("d"), 1 << 20, 100)[1] == 2 + 8 + 5  # incomplete


@pytest.mark.parametrize("args", [(-1, 10, 100, 1, 5), (5, 4, 100, 1, 5), (0, 99, 100, 1, 5), (0, 10, 256, 1, 5), (0, 10, 100, -1, 5), (0, 10, 100, 1, -1)])
def test_take_frames_bad_arguments(impl: str, args: tuple[int, ...]) -> None:
    start, end, tag, max_length, limit = args
    with pytest.raises(ValueError):
        kernel(impl, PQ).take_frames(bytearray(20), start, end, tag, max_length, limit)


@settings(max_examples=300, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=300), max_size=8),
    noise=st.binary(max_size=40),
    flips=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 255)), max_size=3),
    cut=st.integers(0, 3000),
    max_length=st.sampled_from([0, 4, 50, 1 << 20, (1 << 32) - 1]),
    limit=st.integers(0, 10),
)
@pytest.mark.native
def test_take_frames_native_equals_twin(
    both: tuple[ModuleType, ModuleType], bodies: list[bytes], noise: bytes,
    flips: list[tuple[int, int]], cut: int, max_length: int, limit: int,
) -> None:
    c, py = both
    data = bytearray(_frames(bodies) + noise)
    for at, mask in flips:
        if data:
            data[at % len(data)] ^= mask
    end = min(cut, len(data))

    def outcome(m: ModuleType) -> tuple[object, ...]:
        try:
            out, stop = m.take_frames(data, 0, end, ord("d"), max_length, limit)
        except Exception as exc:
            return ("err", type(exc).__name__)
        return ("ok", [bytes(v) for v in out], stop)

    assert outcome(c) == outcome(py)


# --- take_append_run (framing + AppendRequest decoding + coalescing from the raw stream) ------


def _run_outcome(m: ModuleType, data: bytes | bytearray, start: int, end: int, max_length: int, out_size: int, max_bytes: int) -> tuple[object, ...]:
    out = bytearray(b"\xee" * out_size)
    try:
        r = m.take_append_run(data, start, end, max_length, out, max_bytes)
    except Exception as exc:
        return ("err", type(exc).__name__)
    # the result, the WAL it names, and that nothing beyond it in ``out`` was touched
    n = r[5] - r[4]
    return ("ok", r, bytes(out[:n]), out[n:] == b"\xee" * (out_size - n))


def test_take_append_run_says_what_its_messages_say(impl: str) -> None:
    take = kernel(impl, PQ).take_append_run
    payloads = _appends([100, 0, 1000, 8])
    data = bytearray(b"xx" + _frames(payloads) + _frames([b"q"], b"Q"))
    out = bytearray(1 << 20)
    stop, count, term, gen, begin, end, commit, trunc = take(data, 2, len(data), 1 << 20, out, 1 << 20)
    singles = [decode_proposer_message(p, 3) for p in payloads]
    assert all(isinstance(m, AppendRequest) for m in singles)
    assert count == 4 and stop == 2 + sum(5 + len(p) for p in payloads)
    assert (term, gen) == (singles[0].term, singles[0].generation)  # type: ignore[union-attr]
    assert begin == singles[0].begin_lsn and end == singles[-1].end_lsn  # type: ignore[union-attr]
    assert commit == max(m.commit_lsn for m in singles)  # type: ignore[union-attr]
    assert trunc == max(m.truncate_lsn for m in singles)  # type: ignore[union-attr]
    assert out[: end - begin] == b"".join(bytes(m.wal) for m in singles)  # type: ignore[union-attr]
    # one message is a run too (unlike coalesce_appends): nothing is made per message
    assert take(data, 2, 2 + 5 + len(payloads[0]), 1 << 20, out, 1 << 20)[:2] == (2 + 5 + len(payloads[0]), 1)


def test_take_append_run_stops_where_the_general_decoder_must_take_over(impl: str) -> None:
    take = kernel(impl, PQ).take_append_run
    a = _frames(_appends([10, 10]))
    one = 5 + len(_appends([10])[0])
    out = bytearray(1 << 20)
    tails = {
        "gap": _frames(_appends([10], start=0x1000000 + 21)),
        "other term": _frames(_appends([10], start=0x1000000 + 20, term=4)),
        "other generation": _frames(_appends([10], start=0x1000000 + 20, gen=2)),
        "not an append": _frames([b"gnot an append"]),
        "another tag": _frames(_appends([10], start=0x1000000 + 20), b"D"),
        "incomplete": _frames(_appends([10], start=0x1000000 + 20))[:-1],
        "length below 4": b"d\0\0\0\x03" + b"\0" * 60,
        "header only": b"d\0\0\0\x10",
    }
    for name, tail in tails.items():
        data = a + tail
        assert take(data, 0, len(data), 1 << 20, out, 1 << 20)[:2] == (2 * one, 2), name
    # the first message not taken: count 0, stop == start, nothing else said
    assert take(a, 0, len(a), 1 << 20, out, 9) == (0, 0, 0, 0, 0, 0, 0, 0)  # more WAL than max_bytes
    assert take(a, 0, len(a), 1 << 20, bytearray(9), 100)[1] == 0  # more WAL than fits in out
    assert take(a, 0, len(a), one - 2, out, 100)[1] == 0  # longer than max_length
    assert take(a, 0, one - 1, 1 << 20, out, 100)[1] == 0  # cut by end
    assert take(a, 3, len(a), 1 << 20, out, 100)[1] == 0  # not at a message start
    # the run's size limits: max_bytes and the room in out both count
    assert take(a, 0, len(a), 1 << 20, out, 19)[:2] == (one, 1)
    assert take(a, 0, len(a), 1 << 20, bytearray(19), 100)[:2] == (one, 1)
    assert take(a, 0, len(a), 1 << 20, bytearray(20), 100)[:2] == (2 * one, 2)
    truncated = bytearray(a)
    truncated[one + 5 + 21 : one + 5 + 29] = (0x1000000 + 10 + 11).to_bytes(8, "big")  # claims 11 bytes of WAL, has 10
    assert take(truncated, 0, len(truncated), 1 << 20, out, 100)[:2] == (one, 1)


@pytest.mark.parametrize(
    ("start", "end", "max_length", "max_bytes"),
    [(-1, 10, 100, 100), (5, 4, 100, 100), (0, 99, 100, 100), (0, 10, -1, 100), (0, 10, 100, -1)],
)
def test_take_append_run_bad_arguments(impl: str, start: int, end: int, max_length: int, max_bytes: int) -> None:
    with pytest.raises(ValueError):
        kernel(impl, PQ).take_append_run(bytearray(20), start, end, max_length, bytearray(10), max_bytes)


@pytest.mark.native
def test_take_append_run_bad_buffers_are_the_same_error(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    data = _frames(_appends([10]))
    cases: list[tuple[object, object]] = [
        (data, b"read-only out"), (data, memoryview(bytearray(64))[::2]), ("text", bytearray(10)),
        (memoryview(bytearray(data))[::2], bytearray(10)), (data, None),
    ]
    for src, out in cases:
        a = _outcome(c.take_append_run, src, 0, 0, 100, out, 100)
        assert a[0] == "err" and a == _outcome(py.take_append_run, src, 0, 0, 100, out, 100), (src, out)


@settings(max_examples=250, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=10),
    flips=st.lists(st.tuples(st.integers(0, 40000), st.integers(1, 255)), max_size=3),
    noise=st.binary(max_size=30),
    start=st.integers(0, 60),
    cut=st.integers(0, 40000),
    max_length=st.sampled_from([0, 4, 49, 50, 1100, 1 << 20, (1 << 32) - 1]),
    out_size=st.sampled_from([0, 1, 1000, 3000, 40000]),
    max_bytes=st.integers(0, 40000),
)
@pytest.mark.native
def test_take_append_run_native_equals_twin(
    both: tuple[ModuleType, ModuleType], sizes: list[int], flips: list[tuple[int, int]],
    noise: bytes, start: int, cut: int, max_length: int, out_size: int, max_bytes: int,
) -> None:
    c, py = both
    data = bytearray(noise[: start % 8] + _frames(_appends(sizes)) + noise)
    for at, mask in flips:
        data[at % len(data)] ^= mask
    start = min(start % 8 if start < 50 else start, len(data))
    end = max(start, min(cut, len(data)))
    args = (data, start, end, max_length, out_size, max_bytes)
    assert _run_outcome(c, *args) == _run_outcome(py, *args)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400).map(lambda b: b"d" + b), max_length=st.sampled_from([4, 60, 1 << 20]))
@pytest.mark.native
def test_take_append_run_native_equals_twin_on_random_bytes(both: tuple[ModuleType, ModuleType], data: bytes, max_length: int) -> None:
    c, py = both
    args = (data, 0, len(data), max_length, 500, 500)
    assert _run_outcome(c, *args) == _run_outcome(py, *args)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=12),
    splits=st.lists(st.integers(1, 3000), min_size=1, max_size=8),
    run_bytes=st.sampled_from([1, 2000, 5000, 1 << 20]),
)
def test_the_taker_over_a_stream_cut_anywhere_says_what_the_messages_say(
    sizes: list[int], splits: list[int], run_bytes: int
) -> None:
    """The receive path's contract (style rule 10: any segmentation): bytes arriving in
    pieces of any size, taken by ``AppendRunTaker`` through ``ReceiveBuffer.scan`` and, where
    it takes nothing, decoded one message at a time, give the same appends as decoding every
    message alone: the same WAL in order, the same end LSN, the maximal commit LSN."""
    from protocol.append_runs import AppendRunTaker
    from protocol.buffer import ReceiveBuffer

    payloads = _appends(sizes)
    stream = _frames(payloads)
    singles = [decode_proposer_message(p, 3) for p in payloads]
    buf = ReceiveBuffer(arena_size=4096)
    taker = AppendRunTaker(run_bytes)
    wal = bytearray()
    commits: list[int] = []
    messages = 0
    at = k = 0
    while at < len(stream) or len(buf):
        if at < len(stream):
            step = splits[k % len(splits)]
            k += 1
            buf.append(stream[at : at + step])
            at += step
        while True:
            if buf.scan(taker, 1 << 20):
                run = taker.take()
                assert run is not None
                wal += run.wal
                commits.append(run.commit_lsn)
                messages += run.messages
                continue
            views = buf.take_frames(ord("d"), 1 << 20, 1)
            if not views:
                break
            msg = decode_proposer_message(views[0], 3)
            assert isinstance(msg, AppendRequest)
            wal += msg.wal
            commits.append(msg.commit_lsn)
            messages += 1
        if at >= len(stream):
            break
    assert len(buf) == 0 and messages == len(payloads)
    assert wal == b"".join(bytes(m.wal) for m in singles)  # type: ignore[union-attr]
    assert max(commits) == max(m.commit_lsn for m in singles)  # type: ignore[union-attr]


def _arena(run: AppendRequest | None) -> object:
    assert run is not None and isinstance(run.wal, memoryview)
    return run.wal.obj


def test_the_taker_packs_runs_and_never_reuses_an_arena_under_a_live_run() -> None:
    from protocol.append_runs import AppendRunTaker

    piece = 64 * 1024
    data = bytearray(_frames(_appends([piece] * 8)))
    one = len(data) // 8
    taker = AppendRunTaker(piece)  # one message per run; arenas of 2 x 128 KiB
    runs = []
    for k in range(3):
        assert taker(data, k * one, len(data), 1 << 20) == (k + 1) * one
        run = taker.take()
        assert run is not None and taker.take() is None
        runs.append(run)
    kept = [bytes(r.wal) for r in runs]
    assert taker.pool_size == 1  # packed: three runs, one arena
    assert _arena(runs[1]) is _arena(runs[0])
    # 64 KiB of room left, less than one largest message: the fourth run needs another
    # arena, and the first is still live
    assert taker(data, 3 * one, len(data), 1 << 20) == 4 * one
    fourth = taker.take()
    assert fourth is not None and _arena(fourth) is not _arena(runs[0]) and taker.pool_size == 2
    assert [bytes(r.wal) for r in runs] == kept
    first_arena = id(_arena(runs[0]))  # (not a reference: that would keep it in use)
    del runs, run
    # (the fourth arena fills up; then the first one, free now, is taken again)
    for k in (4, 5, 6):
        assert taker(data, k * one, len(data), 1 << 20) == (k + 1) * one
        last = taker.take()
        assert last is not None
    assert id(_arena(last)) == first_arena and taker.pool_size == 2
    assert bytes(fourth.wal) == bytes(data[3 * one + 5 + 45 : 4 * one])


def test_an_idle_taker_gives_back_every_arena_no_run_uses() -> None:
    from protocol.append_runs import AppendRunTaker

    data = bytearray(_frames(_appends([64 * 1024] * 8)))
    one = len(data) // 8
    taker = AppendRunTaker(64 * 1024)
    kept = []
    for k in range(4):  # three runs fill the first arena, the fourth needs a second one
        assert taker(data, k * one, len(data), 1 << 20) == (k + 1) * one
        kept.append(taker.take())
    assert taker.pool_size == 2
    live = kept[3]
    assert live is not None
    wal = bytes(live.wal)
    del kept
    taker.release_idle_memory()
    assert taker.pool_size == 1 and bytes(live.wal) == wal  # the live run's arena stays
    del live
    taker.release_idle_memory()
    assert taker.pool_size == 0
    assert taker(data, 0, one, 1 << 20) == one and taker.pool_size == 1  # and it starts again


def test_fuzz_harness_takes_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    """``pagestore fuzz take-append-run``'s harness (atheris itself is not needed here): its
    seeds are push streams the twin takes runs from, and a kernel that copies one byte too
    many, or answers differently, fails it."""
    from bench import fuzz

    twin = kernel("python", PQ)
    seeds = tmp_path / "corpus"
    seeds.mkdir()
    fuzz.write_seeds("take-append-run", seeds)
    same = fuzz._harness("take-append-run", twin, twin)

    def overwrites(data: bytes, start: int, end: int, max_length: int, out: bytearray, max_bytes: int) -> tuple[int, ...]:
        r: tuple[int, ...] = twin.take_append_run(data, start, end, max_length, out, max_bytes)
        n = r[5] - r[4]
        if n < len(out):
            out[n] = 0
        return r

    taken = 0
    for seed in sorted(seeds.iterdir()):
        data = seed.read_bytes()
        same(data)
        stream = data[6:]
        taken += twin.take_append_run(stream, 0, len(stream), 1 << 20, bytearray(16_000), 16_000)[1]
        lying = fuzz._harness("take-append-run", SimpleNamespace(take_append_run=overwrites), twin)  # type: ignore[arg-type]
        with pytest.raises(AssertionError, match="differs"):
            lying(data)
    assert taken > 3  # the seeds are real runs
