"""Safekeeper proposer/acceptor messages: round trips (v2 and v3), golden bytes, hostile input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.safekeeper import (
    EMPTY_MCONF,
    MAX_SEND_SIZE,
    AcceptorGreeting,
    AppendRequest,
    AppendResponse,
    MembershipConfiguration,
    Message,
    PageserverFeedback,
    ProposerElected,
    ProposerGreeting,
    ProtocolVersion,
    SafekeeperId,
    TermSwitchEntry,
    VoteRequest,
    VoteResponse,
    _decode_proposer_message,
    decode_acceptor_message,
    decode_proposer_message,
    encode_append_request_header,
    encode_message,
)
from tests.strategies import i64, lsns, u16, u32, u64

uuid16 = st.binary(min_size=16, max_size=16)
tenants = uuid16.map(TenantId)
timelines = uuid16.map(TimelineId)
hosts = st.text(st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]), max_size=20)
members = st.builds(SafekeeperId, u64, hosts, u16)


@st.composite
def mconfs(draw: st.DrawFn) -> MembershipConfiguration:
    generation = draw(u32)
    mem = tuple(draw(st.lists(members, min_size=1 if generation else 0, max_size=3)))
    new = draw(st.none() | st.lists(members, min_size=1, max_size=3).map(tuple))
    return MembershipConfiguration(generation, mem, new)


history = st.lists(st.builds(TermSwitchEntry, u64, lsns), max_size=5).map(tuple)
feedbacks = st.builds(
    PageserverFeedback, u64, lsns, lsns, lsns, i64, u32, st.booleans()
)


@st.composite
def wal_ranges(draw: st.DrawFn) -> tuple[Lsn, Lsn, bytes]:
    wal = draw(st.binary(max_size=300))
    begin = draw(st.integers(0, 2**64 - 1 - len(wal)))
    return Lsn(begin), Lsn(begin + len(wal)), wal


@st.composite
def append_requests(draw: st.DrawFn, v3: bool) -> AppendRequest:
    begin, end, wal = draw(wal_ranges())
    if v3:
        return AppendRequest(
            draw(u64), begin, end, draw(lsns), draw(lsns), wal, generation=draw(u32)
        )
    return AppendRequest(
        draw(u64), begin, end, draw(lsns), draw(lsns), wal,
        term_start_lsn=draw(lsns), proposer_id=draw(uuid16),
    )


v3_proposer = st.one_of(
    st.builds(ProposerGreeting, tenants, timelines, u32, u64, u32, mconf=mconfs()),
    st.builds(VoteRequest, u64, generation=u32),
    st.builds(ProposerElected, u64, lsns, history, generation=u32),
    append_requests(v3=True),
)
v2_proposer = st.one_of(
    st.builds(ProposerGreeting, tenants, timelines, u32, u64, u32, proposer_id=uuid16, tli=u32),
    st.builds(VoteRequest, u64, proposer_id=uuid16),
    st.builds(ProposerElected, u64, lsns, history, timeline_start_lsn=lsns),
    append_requests(v3=False),
)
v3_acceptor = st.one_of(
    st.builds(AcceptorGreeting, u64, u64, mconfs()),
    st.builds(VoteResponse, u64, st.booleans(), lsns, lsns, history, generation=u32),
    st.builds(AppendResponse, u64, lsns, lsns, i64, u64, u64, st.none() | feedbacks, generation=u32),
)
v2_acceptor = st.one_of(
    st.builds(AcceptorGreeting, u64, u64),
    st.builds(VoteResponse, u64, st.booleans(), lsns, lsns, history, timeline_start_lsn=lsns),
    st.builds(AppendResponse, u64, lsns, lsns, i64, u64, u64, st.none() | feedbacks),
)


@given(v3_proposer)
def test_v3_proposer_round_trip(msg: Message) -> None:
    data = encode_message(msg, 3)
    assert decode_proposer_message(data, 3) == msg
    # Trailing bytes are ignored, as in neon (AppendResponse's optional tail is the exception).
    assert decode_proposer_message(data + b"\x00junk", 3) == msg


@given(v2_proposer)
def test_v2_proposer_round_trip(msg: Message) -> None:
    data = encode_message(msg, 2)
    assert decode_proposer_message(data, 2) == msg


@given(v3_acceptor)
def test_v3_acceptor_round_trip(msg: Message) -> None:
    assert decode_acceptor_message(encode_message(msg, 3), 3) == msg


@given(v2_acceptor)
def test_v2_acceptor_round_trip(msg: Message) -> None:
    assert decode_acceptor_message(encode_message(msg, 2), 2) == msg


@given(feedbacks)
def test_feedback_round_trip(fb: PageserverFeedback) -> None:
    assert PageserverFeedback.decode(fb.to_bytes()) == fb


TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))


def test_v3_greeting_golden() -> None:
    msg = ProposerGreeting(
        TENANT, TIMELINE, 150000, 7, 16 * 1024 * 1024,
        mconf=MembershipConfiguration(1, (SafekeeperId(5, "h", 5454),)),
    )
    expected = (
        b"g"
        + TENANT.hex.encode() + b"\0"
        + TIMELINE.hex.encode() + b"\0"
        + b"\x00\x00\x00\x01"  # generation
        + b"\x00\x00\x00\x01" + b"\x00" * 7 + b"\x05" + b"h\0" + b"\x15\x4e"  # one member
        + b"\x00\x00\x00\x00"  # no new members
        + struct.pack(">IQI", 150000, 7, 16 * 1024 * 1024)
    )
    assert encode_message(msg, 3) == expected
    assert decode_proposer_message(expected, 3) == msg


def test_v2_greeting_golden() -> None:
    msg = ProposerGreeting(TENANT, TIMELINE, 150000, 7, 16 << 20, proposer_id=b"P" * 16, tli=1)
    data = encode_message(msg, 2)
    assert len(data) == 80
    assert data[:8] == b"g" + b"\0" * 7
    assert data[8:12] == b"\x02\0\0\0"  # protocol_version 2, LE
    # timeline id comes before tenant id in v2
    assert data[40:56] == TIMELINE.raw and data[56:72] == TENANT.raw


def test_v3_append_request_golden() -> None:
    wal = b"\xAA" * 3
    msg = AppendRequest(9, Lsn(0x100), Lsn(0x103), Lsn(0x80), Lsn(0x40), wal, generation=2)
    data = encode_message(msg, 3)
    assert data == b"a" + struct.pack(">IQQQQQ", 2, 9, 0x100, 0x103, 0x80, 0x40) + wal
    assert len(encode_append_request_header(msg, 3)) == 45
    decoded = decode_proposer_message(data, 3)
    assert isinstance(decoded, AppendRequest)
    assert isinstance(decoded.wal, memoryview)  # a view, not a copy
    assert decoded.wal_bytes == wal


def test_v2_append_header_size() -> None:
    msg = AppendRequest(1, Lsn(8), Lsn(8), Lsn(0), Lsn(0), b"")
    assert len(encode_message(msg, 2)) == 72


def test_v3_append_response_golden_with_feedback() -> None:
    fb = PageserverFeedback(1, Lsn(2), Lsn(3), Lsn(4), 5, shard_number=0)
    msg = AppendResponse(7, Lsn(0x10), Lsn(0x8), pageserver_feedback=fb, generation=3)
    data = encode_message(msg, 3)
    head = b"a" + struct.pack(">IQQQqQQ", 3, 7, 0x10, 0x8, 0, 0, 0)
    assert data.startswith(head)
    blob = data[len(head):]
    assert blob[0] == 5
    assert blob[1:].startswith(b"current_timeline_size\0\x00\x00\x00\x08" + struct.pack(">Q", 1))
    assert decode_acceptor_message(data, 3) == msg
    # without feedback the message ends after hs_catalog_xmin
    assert len(encode_message(AppendResponse(7, Lsn(1), Lsn(1)), 3)) == 1 + 4 + 8 * 6


def test_feedback_aliases_and_unknown_keys() -> None:
    def kv(key: bytes, value: bytes) -> bytes:
        return key + b"\0" + struct.pack(">i", len(value)) + value

    blob = (
        b"\x03"
        + kv(b"last_received_lsn", struct.pack(">Q", 42))
        + kv(b"some_future_key", b"xyz")
        + kv(b"corruption_detected", b"\x01")
    )
    fb = PageserverFeedback.decode(blob)
    assert fb == PageserverFeedback(last_received_lsn=Lsn(42), corruption_detected=True)


@pytest.mark.parametrize("version", [2, 3])
def test_append_request_too_large(version: ProtocolVersion) -> None:
    wal = bytes(MAX_SEND_SIZE + 1)
    msg = AppendRequest(1, Lsn(0), Lsn(len(wal)), Lsn(0), Lsn(0), wal)
    data = encode_message(msg, version)
    with pytest.raises(RemoteProtocolError, match="more than"):
        decode_proposer_message(data, version)


def test_append_request_end_before_begin() -> None:
    data = b"a" + struct.pack(">IQQQQQ", 0, 1, 100, 50, 0, 0)
    with pytest.raises(RemoteProtocolError):
        decode_proposer_message(data, 3)


def test_nonzero_generation_needs_members() -> None:
    msg = ProposerGreeting(TENANT, TIMELINE, 150000, 7, 16 << 20)
    data = bytearray(encode_message(msg, 3))
    gen_at = 1 + 33 + 33
    data[gen_at : gen_at + 4] = b"\0\0\0\x09"
    with pytest.raises(RemoteProtocolError, match="without members"):
        decode_proposer_message(bytes(data), 3)


def test_v2_rejects_generation_and_mconf() -> None:
    with pytest.raises(LocalProtocolError):
        encode_message(VoteRequest(1, generation=1), 2)
    greeting = ProposerGreeting(
        TENANT, TIMELINE, 1, 1, 1, mconf=MembershipConfiguration(1, (SafekeeperId(1, "a", 1),))
    )
    with pytest.raises(LocalProtocolError):
        encode_message(greeting, 2)
    assert EMPTY_MCONF.generation == 0


def test_unknown_tag_and_empty() -> None:
    for version in (2, 3):
        assert version in (2, 3)
        for data in (b"", b"z" + bytes(40), b"\x00" * 80):
            with pytest.raises(RemoteProtocolError):
                decode_proposer_message(data, version)
            with pytest.raises(RemoteProtocolError):
                decode_acceptor_message(data, version)


@pytest.mark.parametrize("version", [2, 3])
@given(data=st.binary(max_size=200))
def test_hostile_bytes_only_remote_errors(version: ProtocolVersion, data: bytes) -> None:
    for decode in (decode_proposer_message, decode_acceptor_message):
        try:
            decode(data, version)
        except RemoteProtocolError as exc:
            assert exc.sqlstate == "XX000"  # what a safekeeper sends for any parse error


@given(v3_proposer | v3_acceptor, st.data())
def test_truncated_v3_messages(msg: Message, data: st.DataObject) -> None:
    raw = encode_message(msg, 3)
    cut = data.draw(st.integers(0, len(raw) - 1))
    decode = (
        decode_proposer_message
        if isinstance(msg, ProposerGreeting | VoteRequest | ProposerElected | AppendRequest)
        else decode_acceptor_message
    )
    # A truncated message either fails cleanly or (AppendResponse: optional feedback tail;
    # greeting strings) still decodes, never another exception type.
    try:
        decode(raw[:cut], 3)
    except RemoteProtocolError:
        pass


@given(v2_proposer, st.data())
def test_truncated_v2_proposer_messages(msg: Message, data: st.DataObject) -> None:
    raw = encode_message(msg, 2)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(RemoteProtocolError):
        decode_proposer_message(raw[:cut], 2)


def _general_decoder(data: bytes) -> Message | str:
    try:
        return _decode_proposer_message(data, 3)
    except RemoteProtocolError as exc:
        return f"{exc.sqlstate}: {exc.msg}"


def _fast_decoder(data: bytes) -> Message | str:
    try:
        return decode_proposer_message(data, 3)
    except RemoteProtocolError as exc:
        return f"{exc.sqlstate}: {exc.msg}"


@given(append_requests(v3=True), st.data())
def test_v3_append_fast_path_matches_the_general_decoder(msg: AppendRequest, data: st.DataObject) -> None:
    wire = encode_message(msg, 3)
    # Well-formed, cut short, with trailing bytes, or with header bytes overwritten.
    cut = data.draw(st.integers(0, len(wire)))
    extra = data.draw(st.binary(max_size=8))
    pos = data.draw(st.integers(0, 44))
    junk = data.draw(st.binary(min_size=1, max_size=8))
    mangled = wire[:pos] + junk + wire[pos + len(junk) :]
    for payload in (wire, wire + extra, wire[:cut], mangled):
        fast = _fast_decoder(payload)
        assert fast == _general_decoder(payload)
        if isinstance(fast, AppendRequest):
            assert isinstance(fast.wal, memoryview)
            assert fast.wal.obj is payload  # a view of the payload, not a copy
    assert _fast_decoder(wire) == msg
