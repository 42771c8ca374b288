"""Pagestream v2/v3 codecs: round trips, golden bytes against protocols.md §1.2-1.3, framing,
stream decoders fed whole / byte-at-a-time / in random segments, and hostile input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.lsn import Lsn
from protocol.pagestream import (
    BLCKSZ,
    NEED_DATA,
    BackendMessage,
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
    RequestStreamDecoder,
    Response,
    ResponseStreamDecoder,
    ResponseWriter,
    SlruKind,
    StreamEnd,
    decode_request,
    decode_response,
    encode_request,
    encode_request_into,
    encode_response,
)
from tests.strategies import i64, lsns, u8, u32, u64

rels = st.builds(RelTag, u32, u32, u32, u8)
kinds = st.sampled_from(list(SlruKind))


def requests(v3: bool) -> st.SearchStrategy[Request]:
    reqids = u64 if v3 else st.just(0)
    return st.one_of(
        st.builds(ExistsRequest, reqids, lsns, lsns, rels),
        st.builds(NblocksRequest, reqids, lsns, lsns, rels),
        st.builds(GetPageRequest, reqids, lsns, lsns, rels, u32),
        st.builds(DbSizeRequest, reqids, lsns, lsns, u32),
        st.builds(GetSlruSegmentRequest, reqids, lsns, lsns, kinds, u32),
    )


pages = st.binary(min_size=BLCKSZ, max_size=BLCKSZ) | st.integers(0, 255).map(
    lambda b: bytes([b]) * BLCKSZ
)
messages = st.text(st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]), max_size=40)


@st.composite
def responses(draw: st.DrawFn, v3: bool) -> Response:
    req = draw(requests(v3))
    if draw(st.booleans()):
        return ErrorResponse.for_request(req, draw(messages))
    match req:
        case ExistsRequest():
            return ExistsResponse(req, draw(st.booleans()))
        case NblocksRequest():
            return NblocksResponse(req, draw(u32))
        case GetPageRequest():
            return GetPageResponse(req, draw(pages))
        case DbSizeRequest():
            return DbSizeResponse(req, draw(i64))
        case GetSlruSegmentRequest():
            n = draw(st.integers(0, 3))
            return GetSlruSegmentResponse(req, bytes([n]) * (n * BLCKSZ))


def _request_of(resp: Response) -> Request:
    if isinstance(resp, ErrorResponse):
        raise AssertionError("no request")
    return resp.request


@given(requests(True))
def test_v3_request_round_trip(req: Request) -> None:
    data = encode_request(req, 3)
    assert decode_request(data, 3) == req
    assert decode_request(data + b"trailing", 3) == req  # trailing bytes ignored


@given(requests(False))
def test_v2_request_round_trip(req: Request) -> None:
    assert decode_request(encode_request(req, 2), 2) == req


@given(responses(True))
def test_v3_response_round_trip(resp: Response) -> None:
    assert decode_response(encode_response(resp, 3), 3) == resp


@given(requests(False), st.data())
def test_v2_response_round_trip(req: Request, data: st.DataObject) -> None:
    resp = data.draw(responses(False).filter(lambda r: True))
    # v2 responses carry no echo: pair the response with its own request.
    if isinstance(resp, ErrorResponse):
        resp = ErrorResponse.for_request(req, resp.message)
        assert decode_response(encode_response(resp, 2), 2, req) == resp
    else:
        assert decode_response(encode_response(resp, 2), 2, resp.request) == resp


@pytest.mark.parametrize(
    ("req", "v3_size", "v2_size"),
    [
        (ExistsRequest(0, Lsn(1), Lsn(1), RelTag(1663, 5, 16384, 0)), 38, 30),
        (NblocksRequest(0, Lsn(1), Lsn(1), RelTag(1663, 5, 16384, 0)), 38, 30),
        (GetPageRequest(0, Lsn(1), Lsn(1), RelTag(1663, 5, 16384, 0), 7), 42, 34),
        (DbSizeRequest(0, Lsn(1), Lsn(1), 5), 29, 21),
        (GetSlruSegmentRequest(0, Lsn(1), Lsn(1), SlruKind.CLOG, 3), 30, 22),
    ],
)
def test_request_sizes(req: Request, v3_size: int, v2_size: int) -> None:
    assert len(encode_request(req, 3)) == v3_size
    assert len(encode_request(req, 2)) == v2_size


def test_getpage_request_golden() -> None:
    req = GetPageRequest(0x0102, Lsn(0xFFFF_FFFF_FFFF_FFFF), Lsn(0x16ABCDE), RelTag(1663, 5, 16384, 2), 9)
    expected_v3 = (
        b"\x02"
        + (0x0102).to_bytes(8, "big")
        + b"\xff" * 8
        + (0x16ABCDE).to_bytes(8, "big")
        + (1663).to_bytes(4, "big")
        + (5).to_bytes(4, "big")
        + (16384).to_bytes(4, "big")
        + b"\x02"
        + (9).to_bytes(4, "big")
    )
    assert encode_request(req, 3) == expected_v3
    # v2: no reqid
    assert encode_request(attrs_evolve_reqid0(req), 2) == b"\x02" + expected_v3[9:]


def attrs_evolve_reqid0(req: GetPageRequest) -> GetPageRequest:
    return GetPageRequest(0, req.request_lsn, req.not_modified_since, req.rel, req.blkno)


def test_response_golden_and_sizes() -> None:
    rel = RelTag(1663, 5, 16384, 0)
    page = bytes(range(256)) * 32
    gp = GetPageRequest(7, Lsn(0x20), Lsn(0x10), rel, 3)
    v3 = encode_response(GetPageResponse(gp, page), 3)
    assert len(v3) == 8234
    assert v3[:42] == struct.pack(">BQQQIIIBI", 102, 7, 0x20, 0x10, 1663, 5, 16384, 0, 3)
    assert v3[42:] == page
    assert encode_response(GetPageResponse(gp, page), 2) == b"\x66" + page
    ex = ExistsRequest(7, Lsn(0x20), Lsn(0x10), rel)
    assert len(encode_response(ExistsResponse(ex, True), 3)) == 39
    assert encode_response(ExistsResponse(ex, True), 2) == b"\x64\x01"
    nb = NblocksRequest(7, Lsn(0x20), Lsn(0x10), rel)
    assert len(encode_response(NblocksResponse(nb, 5), 3)) == 42
    assert encode_response(NblocksResponse(nb, 5), 2) == b"\x65\x00\x00\x00\x05"
    db = DbSizeRequest(7, Lsn(0x20), Lsn(0x10), 5)
    assert len(encode_response(DbSizeResponse(db, 8192), 3)) == 37
    assert encode_response(DbSizeResponse(db, 8192), 2) == b"\x68" + (8192).to_bytes(8, "big")
    err = ErrorResponse.for_request(gp, "oops")
    assert encode_response(err, 3) == struct.pack(">BQQQ", 103, 7, 0x20, 0x10) + b"oops\0"
    assert encode_response(err, 2) == b"\x67oops\0"
    sl = GetSlruSegmentRequest(7, Lsn(0x20), Lsn(0x10), SlruKind.MULTIXACT_OFFSETS, 4)
    seg = b"\x01" * (2 * BLCKSZ)
    v3s = encode_response(GetSlruSegmentResponse(sl, seg), 3)
    assert v3s[:34] == struct.pack(">BQQQBII", 105, 7, 0x20, 0x10, 2, 4, 2)
    assert encode_response(GetSlruSegmentResponse(sl, seg), 2) == b"\x69\x00\x00\x00\x02" + seg


@pytest.mark.parametrize("version", [2, 3])
@given(resps=st.lists(responses(True), max_size=5))
def test_framed_writer_is_copydata_of_unframed(version: PagestreamVersion, resps: list[Response]) -> None:
    framed = ResponseWriter(version, framed=True)
    expected = bytearray()
    for resp in resps:
        framed.write(resp)
        payload = encode_response(resp, version)
        expected += b"d" + struct.pack(">I", len(payload) + 4) + payload
    assert framed.take() == expected
    assert framed.buf == b""


def test_v3_response_mismatch_is_refused() -> None:
    rel = RelTag(1663, 5, 16384, 0)
    req = GetPageRequest(1, Lsn(5), Lsn(5), rel, 1)
    other = GetPageRequest(2, Lsn(5), Lsn(5), rel, 1)
    data = encode_response(GetPageResponse(req, bytes(BLCKSZ)), 3)
    assert decode_response(data, 3, req) == GetPageResponse(req, bytes(BLCKSZ))
    with pytest.raises(RemoteProtocolError, match="does not answer"):
        decode_response(data, 3, other)
    with pytest.raises(RemoteProtocolError):
        decode_response(encode_response(NblocksResponse(NblocksRequest(0, Lsn(1), Lsn(1), rel), 1), 2), 2, req)
    with pytest.raises(LocalProtocolError):
        decode_response(data, 2)


def test_writer_refuses_bad_pages() -> None:
    req = GetPageRequest(1, Lsn(5), Lsn(5), RelTag(1, 1, 1, 0), 1)
    with pytest.raises(LocalProtocolError):
        ResponseWriter(3).get_page(req, b"short")
    with pytest.raises(LocalProtocolError):
        encode_request(req, 2)  # v2 has no reqid


# ---------------------------------------------------------------------------------------------
# Stream decoder


def _framed_requests(reqs: list[Request], version: PagestreamVersion) -> bytes:
    buf = bytearray()
    for r in reqs:
        encode_request_into(buf, r, version, framed=True)
    return bytes(buf)


def _drain(decoder: RequestStreamDecoder) -> list[Request | StreamEnd]:
    out: list[Request | StreamEnd] = []
    while True:
        ev = decoder.next_event()
        if ev is NEED_DATA:
            return out
        assert not isinstance(ev, type(NEED_DATA))
        out.append(ev)
        if isinstance(ev, StreamEnd):
            return out


@given(st.lists(requests(True), max_size=8), st.data())
def test_stream_decoder_any_segmentation(reqs: list[Request], data: st.DataObject) -> None:
    raw = _framed_requests(reqs, 3) + b"c\0\0\0\4"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=10)))
    decoder = RequestStreamDecoder(3)
    events: list[Request | StreamEnd] = []
    prev = 0
    for cut in [*cuts, len(raw)]:
        if cut > prev:  # an empty chunk would mean EOF
            decoder.receive_data(raw[prev:cut])
        prev = cut
        events += _drain(decoder)
    assert events == [*reqs, StreamEnd.COPY_DONE]


def test_stream_decoder_byte_at_a_time_and_eof() -> None:
    reqs: list[Request] = [
        GetPageRequest(i, Lsn(100), Lsn(50), RelTag(1663, 5, 16384, 0), i) for i in range(3)
    ]
    raw = _framed_requests(reqs, 3)
    decoder = RequestStreamDecoder(3)
    events: list[Request | StreamEnd] = []
    for i in range(len(raw)):
        decoder.receive_data(raw[i : i + 1])
        events += _drain(decoder)
    decoder.receive_data(b"")
    events += _drain(decoder)
    assert events == [*reqs, StreamEnd.TERMINATE]


def test_stream_decoder_initial_bytes_flush_sync_and_terminate() -> None:
    req = DbSizeRequest(0, Lsn(1), Lsn(1), 5)
    raw = _framed_requests([req], 2)
    decoder = RequestStreamDecoder(2, initial=raw[:3])
    decoder.receive_data(raw[3:] + b"H\0\0\0\4S\0\0\0\4X\0\0\0\4")
    assert _drain(decoder) == [req, StreamEnd.TERMINATE]


@pytest.mark.parametrize(
    ("raw", "sqlstate", "match"),
    [
        (b"d\0\0\0\5\x09", "XX000", "invalid tag 9"),
        (b"d\0\0\0\4", "XX000", "empty"),
        (b"d\0\0\0\x08\x02abc", "XX000", "truncated"),
        (b"Q\0\0\0\x09abcd\0", "08P01", "unexpected message"),
        (b"d\0\0\0\x02", "08P01", "bad message length"),
        (b"d\xff\xff\xff\xff", "08P01", "bad message length"),
        (b"f\0\0\0\x05\0", "XX000", "CopyFail"),
    ],
)
def test_stream_decoder_errors(raw: bytes, sqlstate: str, match: str) -> None:
    decoder = RequestStreamDecoder(3)
    decoder.receive_data(raw)
    with pytest.raises(RemoteProtocolError, match=match) as info:
        decoder.next_event()
    assert info.value.sqlstate == sqlstate
    with pytest.raises(RemoteProtocolError):  # dead after an error
        decoder.next_event()


def test_stream_decoder_truncated_at_eof() -> None:
    raw = _framed_requests([DbSizeRequest(0, Lsn(1), Lsn(1), 5)], 3)
    decoder = RequestStreamDecoder(3)
    decoder.receive_data(raw[:-1])
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a message"):
        decoder.next_event()


def test_slru_kind_out_of_range() -> None:
    raw = bytearray(encode_request(GetSlruSegmentRequest(0, Lsn(1), Lsn(1), SlruKind.CLOG, 1), 3))
    raw[25] = 3
    with pytest.raises(RemoteProtocolError, match="SLRU kind"):
        decode_request(bytes(raw), 3)


@pytest.mark.parametrize("version", [2, 3])
@given(data=st.binary(max_size=64))
def test_hostile_payloads(version: PagestreamVersion, data: bytes) -> None:
    try:
        decode_request(data, version)
    except RemoteProtocolError:
        pass
    try:
        decode_response(data, version, GetPageRequest(0, Lsn(1), Lsn(1), RelTag(1, 1, 1, 0), 0))
    except RemoteProtocolError:
        pass


@pytest.mark.parametrize("version", [2, 3])
@given(data=st.binary(max_size=200))
def test_hostile_stream(version: PagestreamVersion, data: bytes) -> None:
    decoder = RequestStreamDecoder(version)
    decoder.receive_data(data)
    decoder.receive_data(b"")
    try:
        for _ in range(100):
            if isinstance(decoder.next_event(), StreamEnd):
                break
    except RemoteProtocolError:
        pass


@given(st.lists(requests(True), min_size=1, max_size=5), st.data())
def test_truncated_requests_are_refused(reqs: list[Request], data: st.DataObject) -> None:
    raw = encode_request(reqs[0], 3)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(RemoteProtocolError):
        decode_request(raw[:cut], 3)


def test_response_stream_decoder() -> None:
    req = NblocksRequest(1, Lsn(1), Lsn(1), RelTag(1, 1, 1, 0))
    w = ResponseWriter(3)
    w.nblocks(req, 12)
    raw = bytes(w.take()) + b"E\0\0\0\x0bSERROR\0" + b"Z\0\0\0\5I"
    decoder = ResponseStreamDecoder()
    for i in range(len(raw)):
        decoder.receive_data(raw[i : i + 1])
    first = decoder.next_event()
    assert isinstance(first, bytes)
    assert decode_response(first, 3, req) == NblocksResponse(req, 12)
    assert decoder.next_event() == BackendMessage(b"E", b"SERROR\0")
    assert decoder.next_event() == BackendMessage(b"Z", b"I")
    assert decoder.next_event() is NEED_DATA
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed"):
        decoder.next_event()
