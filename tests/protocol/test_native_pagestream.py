"""The pagestream batch codec (kernel 2): compiled (protocol/_pagestream_c.pyx) against the
pure-Python twin and against the one-message codec of protocol/pagestream.py.

- ``decode_getpages`` takes exactly the run of well-formed GetPages at the start of a buffer
  (the same requests the protocol decoder reads), stops at anything else, and both twins
  agree on random, cut and mutated streams.
- ``encode_getpage_responses`` writes the bytes ``ResponseWriter.get_page`` writes, one
  response per page, and nothing at all when a page is not 8192 bytes.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.lsn import Lsn
from protocol.pagestream import (
    ExistsRequest,
    GetPageRequest,
    RelTag,
    Request,
    RequestStreamDecoder,
    ResponseWriter,
    encode_request_into,
)
from tests.conftest import kernel

PS = "protocol._pagestream_c"


def _stream(reqs: list[Request], version: int) -> bytes:
    buf = bytearray()
    for r in reqs:
        encode_request_into(buf, r, version, framed=True)  # type: ignore[arg-type]
    return bytes(buf)


def _gp(i: int, version: int, rel: int = 16384) -> GetPageRequest:
    return GetPageRequest(i if version == 3 else 0, Lsn(0x1000 + i), Lsn(i), RelTag(1663, 5, rel + i % 3, i % 4), 7 * i)


def _decode(mod: ModuleType, data: bytes, version: int, limit: int = 1000, pos: int = 0) -> tuple[object, ...]:
    try:
        got, end = mod.decode_getpages(data, pos, len(data), version == 3, limit, GetPageRequest, RelTag, {})
    except Exception as exc:
        return ("err", type(exc).__name__)
    return ("ok", got, end)


@pytest.fixture(scope="module")
def both() -> tuple[ModuleType, ModuleType]:
    return kernel("native", PS), kernel("python", PS)


@pytest.mark.parametrize("version", [2, 3])
def test_decodes_the_getpage_run_the_protocol_decoder_reads(impl: str, version: int) -> None:
    mod = kernel(impl, PS)
    reqs: list[Request] = [_gp(i, version) for i in range(10)]
    other = ExistsRequest(0 if version == 2 else 99, Lsn(5), Lsn(0), RelTag(1663, 5, 1, 0))
    data = _stream([*reqs, other, _gp(50, version)], version)
    ok, got, end = _decode(mod, data, version)
    assert ok == "ok" and got == reqs
    assert end == len(_stream(reqs, version))  # stopped at the Exists, left whole
    dec = RequestStreamDecoder(version)  # type: ignore[arg-type]
    dec.receive_data(data)
    assert [dec.next_event() for _ in range(10)] == got
    assert _decode(mod, data, version, limit=3)[1:] == (reqs[:3], len(_stream(reqs[:3], version)))


def test_relation_tags_are_shared_and_the_cache_bounded(impl: str) -> None:
    mod = kernel(impl, PS)
    rels: dict[tuple[int, int, int, int], RelTag] = {}
    data = _stream([GetPageRequest(i, Lsn(9), Lsn(0), RelTag(1663, 5, 16384, 0), i) for i in range(5)], 3)
    got, _ = mod.decode_getpages(data, 0, len(data), True, 100, GetPageRequest, RelTag, rels)
    assert all(r.rel is got[0].rel for r in got) and len(rels) == 1
    many = _stream([GetPageRequest(i, Lsn(9), Lsn(0), RelTag(1663, 5, i, 0), i) for i in range(mod.MAX_CACHED_RELS + 5)], 3)
    mod.decode_getpages(many, 0, len(many), True, 10_000, GetPageRequest, RelTag, rels)
    assert len(rels) <= mod.MAX_CACHED_RELS


@attrs.frozen
class _Checked:
    """The request's fields with a validator: ``cls(...)`` does more than set them."""

    reqid: int
    request_lsn: int
    not_modified_since: int
    rel: RelTag
    blkno: int = attrs.field(validator=attrs.validators.lt(10**6))


@attrs.define
class _OwnInit:
    reqid: int
    request_lsn: int
    not_modified_since: int
    rel: RelTag
    blkno: int

    def __init__(self, *args: Any) -> None:
        calls.append(args)
        self.__attrs_init__(*args)  # type: ignore[attr-defined]


calls: list[tuple[Any, ...]] = []


@pytest.mark.parametrize("make", [GetPageRequest, _Checked, _OwnInit, lambda *a: ("made", *a)])
def test_every_kind_of_make_request_gets_what_calling_it_makes(impl: str, make: Any) -> None:
    """A plain attrs record (GetPageRequest) may be built without its ``__init__`` frame by
    the kernel; anything that does more (a validator, its own ``__init__``, any callable) is
    called. Either way the requests equal ``make(...)`` of each message's fields, and a
    class's own ``__init__`` runs once per request."""
    mod = kernel(impl, PS)
    reqs = [_gp(i, 3) for i in range(6)]
    data = _stream(reqs, 3)  # type: ignore[arg-type]
    calls.clear()
    got, end = mod.decode_getpages(data, 0, len(data), True, 100, make, RelTag, {})
    fields = [(r.reqid, r.request_lsn, r.not_modified_since, r.rel, r.blkno) for r in reqs]
    expected = [make(*f) for f in fields]
    assert got == expected and end == len(data)
    assert [type(g) for g in got] == [type(e) for e in expected]
    if make is _OwnInit:
        assert calls == fields + fields  # the kernel's six, then ours


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1],  # incomplete: left for more data
        lambda b: b[:5] + b"\x03" + b[6:],  # another request tag
        lambda b: b[:1] + (47).to_bytes(4, "big") + b[5:] + b"x",  # longer than a GetPage
        lambda b: b"c" + b[1:],  # not CopyData
        lambda b: b"",
    ],
)
def test_stops_at_the_first_message_that_is_not_exactly_a_getpage(impl: str, mutate: object) -> None:
    mod = kernel(impl, PS)
    one = _stream([_gp(1, 3)], 3)
    data = one + mutate(one)  # type: ignore[operator]
    assert _decode(mod, data, 3) == ("ok", [_gp(1, 3)], len(one))


@pytest.mark.parametrize("args", [(5, 3, 10), (0, 100, 10), (0, 3, -1), (-1, 3, 10)])
def test_bad_ranges(impl: str, args: tuple[int, int, int]) -> None:
    pos, end, limit = args
    with pytest.raises(ValueError):
        kernel(impl, PS).decode_getpages(b"abc", pos, end, True, limit, GetPageRequest, RelTag, {})


@pytest.mark.parametrize("version", [2, 3])
def test_encode_writes_what_get_page_writes(impl: str, version: int) -> None:
    mod = kernel(impl, PS)
    reqs = [_gp(i, version) for i in range(6)]
    pages = [bytes([i]) * 8192 for i in range(5)] + [memoryview(bytearray(b"z" * 8192))]
    w = ResponseWriter(version)  # type: ignore[arg-type]
    for r, p in zip(reqs, pages, strict=True):
        w.get_page(r, p)
    out = bytearray(b"prefix")
    mod.encode_getpage_responses(out, version == 3, reqs, pages)
    assert bytes(out) == b"prefix" + bytes(w.take())


@pytest.mark.parametrize("pages", [[b"x" * 8191], [b"x" * 8193], [b"x" * 8192, b""], [b"x" * 8192] * 3])
def test_encode_refuses_whole_batches_with_a_bad_page_or_count(impl: str, pages: list[bytes]) -> None:
    mod = kernel(impl, PS)
    out = bytearray(b"keep")
    with pytest.raises(ValueError):
        mod.encode_getpage_responses(out, True, [_gp(i, 3) for i in range(2)], pages)
    assert out == b"keep"


@pytest.mark.parametrize("bad", [bytearray(b"x" * 8191), memoryview(b"x" * 8193), b""])
def test_encode_checks_every_page_before_writing_any(impl: str, bad: bytes) -> None:
    # a bad page after good ones of every buffer kind: nothing of the batch is written
    mod = kernel(impl, PS)
    out = bytearray(b"keep")
    pages = [b"a" * 8192, bytearray(b"b" * 8192), memoryview(b"c" * 8192), bad]
    with pytest.raises(ValueError):
        mod.encode_getpage_responses(out, True, [_gp(i, 3) for i in range(4)], pages)
    assert out == b"keep"


def test_encode_wants_a_bytearray(impl: str) -> None:
    with pytest.raises(TypeError):
        kernel(impl, PS).encode_getpage_responses(b"", True, [_gp(0, 3)], [b"x" * 8192])


def test_writer_get_pages_is_get_page_per_page() -> None:
    reqs = [_gp(i, 3) for i in range(4)]
    pages = [bytes([i]) * 8192 for i in range(4)]
    a, b = ResponseWriter(3), ResponseWriter(3)
    a.get_pages(reqs, pages)
    for r, p in zip(reqs, pages, strict=True):
        b.get_page(r, p)
    assert a.take() == b.take()


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 20),
    version=st.sampled_from([2, 3]),
    flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=3),
    cut=st.integers(0, 2000),
    pos=st.integers(0, 100),
    limit=st.integers(0, 30),
)
@pytest.mark.native
def test_native_equals_twin_on_mutated_streams(
    both: tuple[ModuleType, ModuleType], n: int, version: int,
    flips: list[tuple[int, int]], cut: int, pos: int, limit: int,
) -> None:
    c, py = both
    data = bytearray(_stream([_gp(i, version) for i in range(n)], version))
    for at, mask in flips:
        if data:
            data[at % len(data)] ^= mask
    data = data[: len(data) - cut % (len(data) + 1)]
    pos = pos % (len(data) + 1)
    assert _decode(c, bytes(data), version, limit, pos) == _decode(py, bytes(data), version, limit, pos)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), version=st.sampled_from([2, 3]))
@pytest.mark.native
def test_native_equals_twin_on_random_bytes(both: tuple[ModuleType, ModuleType], data: bytes, version: int) -> None:
    c, py = both
    for d in (data, b"d" + data):
        assert _decode(c, d, version) == _decode(py, d, version)
