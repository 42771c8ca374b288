"""The GetPage load generator (kernel 4): compiled (protocol/_getpage_load_c.pyx) against the
pure-Python twin, and both against the pagestream codec of protocol/pagestream.py.

- What it sends are GetPage requests the server's decoder reads back (uniform blocks, fresh
  reqids); answers written by the server's ``ResponseWriter`` are taken in any segmentation.
- Hostile server bytes (wrong length, tag, echo, truncated errors, libpq errors) are the
  same error class in both; random and mutated streams give the same outcome in both.
"""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.lsn import Lsn
from protocol.pagestream import (
    GetPageRequest,
    RelTag,
    RequestStreamDecoder,
    ResponseWriter,
)
from tests.conftest import kernel

LOAD = "protocol._getpage_load_c"
REL = (1663, 5, 16384, 0)


def _page(blk: int) -> bytes:
    return (blk.to_bytes(4, "big") * 2048)[:8192]


def _requests_of(data: bytes) -> list[GetPageRequest]:
    dec = RequestStreamDecoder(3)
    dec.receive_data(data)
    out = []
    while isinstance(ev := dec.next_event(), GetPageRequest):
        out.append(ev)
    return out


def _answer(reqs: list[GetPageRequest]) -> bytes:
    w = ResponseWriter(3)
    for r in reqs:
        w.get_page(r, _page(r.blkno))
    return bytes(w.take())


def _outcome(load: object, chunks: list[bytes], resend: bool) -> tuple[object, ...]:
    sent: list[bytes] = []
    try:
        for i, chunk in enumerate(chunks):
            sent.append(load.feed(chunk, 10_000 * (i + 1), resend))  # type: ignore[attr-defined]
    except Exception as exc:
        return ("err", type(exc).__name__, sent)
    return ("ok", sent, load.count, load.in_flight, list(load.latencies_us()))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def both() -> tuple[ModuleType, ModuleType]:
    return kernel("native", LOAD), kernel("python", LOAD)


def test_requests_are_getpages_the_server_decodes(impl: str) -> None:
    mod = kernel(impl, LOAD)
    load = mod.GetPageLoad(REL, 100, seed=7, first_reqid=5)
    reqs = _requests_of(load.requests(32, 0))
    assert [r.reqid for r in reqs] == list(range(5, 37))
    assert all(r.rel == RelTag(*REL) and 0 <= r.blkno < 100 for r in reqs)
    assert all(r.request_lsn == Lsn(0xFFFF_FFFF_FFFF_FFFF) and r.not_modified_since == 0 for r in reqs)
    assert len({r.blkno for r in reqs}) > 10  # random, not one block
    assert load.in_flight == 32


@pytest.mark.parametrize("cut", [1, 5, 100, 8233, 8234, 8239, 20000, 1 << 20])
def test_a_closed_loop_in_any_segmentation(impl: str, cut: int) -> None:
    mod = kernel(impl, LOAD)
    load = mod.GetPageLoad(REL, 1000, seed=1)
    in_flight = _requests_of(load.requests(8, 1_000))
    answers = _answer(in_flight)
    resent = b""
    for i in range(0, len(answers), cut):
        resent += load.feed(answers[i : i + cut], 5_000_000, True)
    assert load.count == 8 and load.in_flight == 8
    assert [r.reqid for r in _requests_of(resent)] == list(range(9, 17))
    assert list(load.latencies_us()) == [4999] * 8
    # ... and once the deadline passed, nothing more is sent
    assert load.feed(_answer(_requests_of(resent)), 6_000_000, False) == b""
    assert load.in_flight == 0 and load.count == 16


def test_both_send_the_same_blocks(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    a, b = c.GetPageLoad(REL, 12345, seed=99), py.GetPageLoad(REL, 12345, seed=99)
    assert a.requests(500, 3) == b.requests(500, 3)


RELS = [(1663, 5, 16384, 0), (1663, 5, 16384, 1), (1663, 1, 1259, 0), (1664, 0, 1262, 0)]
SIZES = [1000, 3, 1, 20]


def test_several_relations_every_block_equally_likely(impl: str) -> None:
    """pagebench's key choice: uniform over every block of every relation, so a relation is
    picked in proportion to its size; each answer is checked against its own relation."""
    mod = kernel(impl, LOAD)
    load = mod.GetPageLoad(RELS, SIZES, seed=5)
    assert load.pages == sum(SIZES)
    reqs = _requests_of(load.requests(20_000, 0))
    counts = dict.fromkeys(RELS, 0)
    for r in reqs:
        rel = (r.rel.spcnode, r.rel.dbnode, r.rel.relnode, r.rel.forknum)
        assert 0 <= r.blkno < SIZES[RELS.index(rel)]
        counts[rel] += 1
    for rel, size in zip(RELS, SIZES, strict=True):
        expected = 20_000 * size / sum(SIZES)
        assert abs(counts[rel] - expected) < 5 * expected**0.5 + 3, (rel, counts[rel], expected)
    assert {r.blkno for r in reqs if r.rel == RelTag(*RELS[3])} == set(range(20))
    resent = load.feed(_answer(reqs), 1_000, True)
    assert load.count == 20_000 and len(_requests_of(resent)) == 20_000


def test_one_relation_in_a_list_sends_what_the_plain_form_sends(impl: str) -> None:
    mod = kernel(impl, LOAD)
    a, b = mod.GetPageLoad(REL, 777, seed=3), mod.GetPageLoad([REL], [777], seed=3)
    assert a.requests(300, 0) == b.requests(300, 0)


def test_an_answer_for_another_relation_is_refused(impl: str) -> None:
    mod = kernel(impl, LOAD)
    load = mod.GetPageLoad(RELS[:2], [5, 5], seed=1)
    first = _requests_of(load.requests(1, 0))[0]
    other = RelTag(*(RELS[1] if first.rel == RelTag(*RELS[0]) else RELS[0]))
    wrong = GetPageRequest(first.reqid, first.request_lsn, first.not_modified_since, other, first.blkno)
    with pytest.raises(mod.LoadProtocolError):
        load.feed(_answer([wrong]), 1, True)


def test_both_send_the_same_blocks_of_several_relations(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    a, b = c.GetPageLoad(RELS, SIZES, seed=42), py.GetPageLoad(RELS, SIZES, seed=42)
    assert a.requests(2000, 3) == b.requests(2000, 3)


@pytest.mark.parametrize(
    ("rels", "sizes"),
    [([], []), (RELS, SIZES[:2]), ([REL, REL], [10, 0]), ([REL, (1663, 5, 1, 256)], [1, 1]),
     ([REL], [1 << 32 | 1])],
)
def test_bad_relation_lists(impl: str, rels: list[tuple[int, ...]], sizes: list[int]) -> None:
    with pytest.raises(ValueError):
        kernel(impl, LOAD).GetPageLoad(rels, sizes, 0)


def _framed(payload: bytes) -> bytes:
    return b"d" + (4 + len(payload)).to_bytes(4, "big") + payload


def _hostile_streams(load_requests: list[GetPageRequest]) -> dict[str, bytes]:
    first = load_requests[0]
    good = _answer([first])
    wrong_blk = _answer([GetPageRequest(first.reqid, first.request_lsn, first.not_modified_since, first.rel, first.blkno + 1)])
    wrong_reqid = _answer([GetPageRequest(first.reqid + 1, first.request_lsn, first.not_modified_since, first.rel, first.blkno)])
    w = ResponseWriter(3)
    w.error(first, "no such page")
    error = bytes(w.take())
    body = b"SERROR\0C57P01\0Mbye\0\0"
    libpq_error = b"E" + (4 + len(body)).to_bytes(4, "big") + body
    return {
        "short_length": b"d\0\0\0\3",
        "huge_length": b"d\x7f\0\0\0",
        "other_message": b"Z\0\0\0\5I",
        "empty_payload": b"d\0\0\0\4",
        "unknown_tag": b"d\0\0\0\5\x01",
        "truncated_page": _framed(good[5 : 5 + 42 + 100]),
        "long_page": _framed(good[5:] + b"x"),
        "wrong_block": wrong_blk,
        "wrong_reqid": wrong_reqid,
        "truncated_error": b"d\0\0\0\x0a\x67" + b"\0" * 5,
        "error": error,
        "libpq_error": libpq_error,
        "extra_answer": good + good,
    }


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("short_length", "LoadProtocolError"),
        ("huge_length", "LoadProtocolError"),
        ("other_message", "LoadProtocolError"),
        ("empty_payload", "LoadProtocolError"),
        ("unknown_tag", "LoadProtocolError"),
        ("truncated_page", "LoadProtocolError"),
        ("long_page", "LoadProtocolError"),
        ("wrong_block", "LoadProtocolError"),
        ("wrong_reqid", "LoadProtocolError"),
        ("truncated_error", "LoadProtocolError"),
        ("error", "LoadServerError"),
        ("libpq_error", "LoadServerError"),
        ("extra_answer", "LoadProtocolError"),
    ],
)
def test_hostile_server_bytes(impl: str, name: str, error: str) -> None:
    mod = kernel(impl, LOAD)
    load = mod.GetPageLoad(REL, 50, seed=3)
    reqs = _requests_of(load.requests(1, 0))
    with pytest.raises(getattr(mod, error)) as info:
        load.feed(_hostile_streams(reqs)[name], 1, True)
    if name == "error":
        assert "no such page" in str(info.value)
    if name == "libpq_error":
        assert str(info.value) == "bye"


@pytest.mark.parametrize(
    "args",
    [((1663, 5, 16384, 256), 10, 0), ((1 << 32, 5, 1, 0), 10, 0), (REL, 0, 0), (REL, 1 << 33, 0), (REL, 10, -1)],
)
def test_bad_arguments(impl: str, args: tuple[object, ...]) -> None:
    with pytest.raises(ValueError):
        kernel(impl, LOAD).GetPageLoad(*args)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 12),
    cuts=st.lists(st.integers(1, 30000), max_size=6),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=3),
    trim=st.integers(0, 20000),
    resend=st.booleans(),
)
@pytest.mark.native
def test_native_equals_twin_on_mutated_streams(
    both: tuple[ModuleType, ModuleType], n: int, cuts: list[int],
    flips: list[tuple[int, int]], trim: int, resend: bool,
) -> None:
    c, py = both
    loads = [m.GetPageLoad(REL, 64, seed=n) for m in (c, py)]
    reqs = [lo.requests(n, 0) for lo in loads]
    assert reqs[0] == reqs[1]
    stream = bytearray(_answer(_requests_of(reqs[0])))
    for at, mask in flips:
        stream[at % len(stream)] ^= mask
    del stream[len(stream) - trim % len(stream):]
    chunks, at = [], 0
    for cut in cuts:
        chunks.append(bytes(stream[at : at + cut]))
        at += cut
    chunks.append(bytes(stream[at:]))
    assert _outcome(loads[0], chunks, resend) == _outcome(loads[1], chunks, resend)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), n=st.integers(0, 3))
@pytest.mark.native
def test_native_equals_twin_on_random_bytes(both: tuple[ModuleType, ModuleType], data: bytes, n: int) -> None:
    c, py = both
    framed = _framed(data)
    for chunks in ([data], [framed], [framed[:3], framed[3:]]):
        loads = [m.GetPageLoad(REL, 64, seed=1) for m in (c, py)]
        for lo in loads:
            lo.requests(n, 0)
        assert _outcome(loads[0], chunks, True) == _outcome(loads[1], chunks, True)


@pytest.mark.native
def test_same_names_and_signatures(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    assert c.__all__ == py.__all__
    public = {m for m in dir(py.GetPageLoad) if not m.startswith("_")}
    assert public <= set(dir(c.GetPageLoad))
    for name in ("requests", "feed", "latencies_us"):
        sig_c = inspect.signature(getattr(c.GetPageLoad, name))
        sig_py = inspect.signature(getattr(py.GetPageLoad, name))
        assert [p.name for p in sig_c.parameters.values()] == [p.name for p in sig_py.parameters.values()]
