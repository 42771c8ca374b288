"""PostgreSQL wire messages: hypothesis round trips for every message in both directions,
decoders fed whole / byte-at-a-time / with trailing data, and hostile input."""

from __future__ import annotations

import struct
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.pgwire import CLOSED, NEED_DATA, BackendDecoder, FrontendDecoder
from protocol.pgwire import messages as m
from protocol.pgwire.decoder import MAX_STARTUP_PACKET_LEN, SMALL_MESSAGE_LIMIT
from tests.strategies import i16, i32, u32

text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=20)
name = text.filter(bool)
kind = st.sampled_from(["S", "P"])
blob = st.binary(max_size=64)
fields = st.lists(
    st.tuples(st.sampled_from("SVCMDHPpqWsdtcnFLR"), text), max_size=6
).map(tuple)

STARTUP_PACKETS = st.one_of(
    st.builds(m.SSLRequest),
    st.builds(m.GSSENCRequest),
    st.builds(m.CancelRequest, i32, i32),
    st.builds(m.StartupMessage, st.dictionaries(name, text, max_size=5)),
)
TAGGED_FRONTEND = st.one_of(
    st.builds(m.PasswordMessage, text),
    st.builds(m.Query, text),
    st.builds(m.Terminate),
    st.builds(m.CopyData, blob),
    st.builds(m.CopyDone),
    st.builds(m.CopyFail, text),
    st.builds(m.Sync),
    st.builds(m.Flush),
    st.builds(m.Parse, text, text, st.lists(u32, max_size=4).map(tuple)),
    st.builds(
        m.Bind,
        text,
        text,
        st.lists(i16, max_size=3).map(tuple),
        st.lists(st.one_of(st.none(), blob), max_size=3).map(tuple),
        st.lists(i16, max_size=3).map(tuple),
    ),
    st.builds(m.Describe, kind, text),
    st.builds(m.Execute, text, i32),
    st.builds(m.Close, kind, text),
)
BACKEND = st.one_of(
    st.builds(m.AuthenticationOk),
    st.builds(m.AuthenticationCleartextPassword),
    st.builds(m.AuthenticationMD5Password, st.binary(min_size=4, max_size=4)),
    st.builds(m.AuthenticationSASL, st.lists(name, max_size=3).map(tuple)),
    st.builds(m.ParameterStatus, text, text),
    st.builds(m.BackendKeyData, i32, i32),
    st.builds(m.ReadyForQuery, st.sampled_from(["I", "T", "E"])),
    st.builds(
        m.RowDescription,
        st.lists(
            st.builds(m.FieldDescription, text, u32, u32, i16, i16, i32, st.sampled_from([0, 1])),
            max_size=4,
        ).map(tuple),
    ),
    st.builds(m.DataRow, st.lists(st.one_of(st.none(), blob), max_size=5).map(tuple)),
    st.builds(m.CommandComplete, text),
    st.builds(m.EmptyQueryResponse),
    st.builds(m.ErrorResponse, fields),
    st.builds(m.NoticeResponse, fields),
    st.builds(m.CopyInResponse, st.sampled_from([0, 1]), st.lists(i16, max_size=3).map(tuple)),
    st.builds(m.CopyOutResponse, st.sampled_from([0, 1]), st.lists(i16, max_size=3).map(tuple)),
    st.builds(m.CopyBothResponse, st.sampled_from([0, 1]), st.lists(i16, max_size=3).map(tuple)),
    st.builds(m.CopyData, blob),
    st.builds(m.CopyDone),
    st.builds(m.ParseComplete),
    st.builds(m.BindComplete),
    st.builds(m.CloseComplete),
    st.builds(m.NoData),
    st.builds(m.PortalSuspended),
    st.builds(m.ParameterDescription, st.lists(u32, max_size=4).map(tuple)),
    st.builds(m.NotificationResponse, i32, text, text),
    st.builds(m.NegotiateProtocolVersion, i32, st.lists(text, max_size=3).map(tuple)),
)


def drain(decoder: FrontendDecoder | BackendDecoder) -> list[object]:
    out: list[object] = []
    while (ev := decoder.next_event()) is not NEED_DATA and ev is not CLOSED:
        out.append(ev)
    return out


def frontend_stream(startup: list[m.StartupPacket], tagged: list[m.FrontendMessage]) -> bytes:
    # Only one StartupMessage, last among the startup packets; CancelRequest ends a connection.
    pre = [p for p in startup if isinstance(p, m.SSLRequest | m.GSSENCRequest)]
    return m.encode(*pre, m.StartupMessage({"user": "u"}), *tagged)


@given(st.lists(STARTUP_PACKETS, max_size=3), st.lists(TAGGED_FRONTEND, max_size=8))
def test_frontend_round_trip_whole_and_bytewise(
    startup: list[m.StartupPacket], tagged: list[m.FrontendMessage]
) -> None:
    data = frontend_stream(startup, tagged)
    expected: list[object] = [p for p in startup if isinstance(p, m.SSLRequest | m.GSSENCRequest)]
    expected = [*expected, m.StartupMessage({"user": "u"}), *tagged]

    whole = FrontendDecoder()
    whole.receive_data(data)
    assert drain(whole) == expected

    bytewise = FrontendDecoder()
    got: list[object] = []
    for i in range(len(data)):
        bytewise.receive_data(data[i : i + 1])
        got += drain(bytewise)
    assert got == expected
    bytewise.receive_data(b"")
    assert bytewise.next_event() is CLOSED

    # Trailing bytes of a next message stay buffered and are not an error until EOF.
    trailing = FrontendDecoder()
    trailing.receive_data(data + b"Q\x00\x00")
    assert drain(trailing) == expected
    assert trailing.buffered == 3
    trailing.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed by client in the middle"):
        trailing.next_event()


@given(st.lists(st.one_of(TAGGED_FRONTEND, BACKEND), max_size=8), st.data())
def test_random_segmentation(msgs: list[m.Message], data: st.DataObject) -> None:
    backend_types = typing.get_args(m.BackendMessage)
    frontend = [x for x in msgs if not isinstance(x, backend_types)]
    backend = [x for x in msgs if isinstance(x, backend_types)]
    for decoder, stream, expected in (
        (FrontendDecoder(), m.encode(m.StartupMessage({}), *frontend), [m.StartupMessage({}), *frontend]),
        (BackendDecoder(), m.encode(*backend), backend),
    ):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
        got: list[object] = []
        prev = 0
        for cut in [*cuts, len(stream)]:
            if cut > prev:  # b"" would mean EOF
                decoder.receive_data(stream[prev:cut])
            got += drain(decoder)
            prev = cut
        assert got == expected


@given(STARTUP_PACKETS)
def test_each_startup_packet_round_trips(packet: m.StartupPacket) -> None:
    d = FrontendDecoder()
    d.receive_data(m.encode(packet))
    assert d.next_event() == packet
    assert d.next_event() is NEED_DATA


@given(st.lists(BACKEND, max_size=10), st.binary(max_size=3))
def test_backend_round_trip_whole_bytewise_trailing(
    msgs: list[m.BackendMessage], trailing: bytes
) -> None:
    data = m.encode(*msgs)
    whole = BackendDecoder()
    whole.receive_data(data + trailing)
    assert drain(whole) == msgs  # a partial trailing message is left buffered
    assert whole.buffered == len(trailing)

    bytewise = BackendDecoder()
    got: list[object] = []
    for i in range(len(data)):
        bytewise.receive_data(data[i : i + 1])
        got += drain(bytewise)
    assert got == msgs


@given(TAGGED_FRONTEND, st.integers(1, 4))
def test_half_message_at_eof_is_remote_error(msg: m.FrontendMessage, cut: int) -> None:
    d = FrontendDecoder()
    data = m.encode(m.StartupMessage({}), msg)
    d.receive_data(data[:-cut])  # every tagged message is at least 5 bytes long
    d.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed"):
        drain(d)


def _hostile(decoder: FrontendDecoder | BackendDecoder, data: bytes) -> None:
    try:
        for i in range(0, len(data), 7):
            decoder.receive_data(data[i : i + 7])
            drain(decoder)
        decoder.receive_data(b"")
        drain(decoder)
    except RemoteProtocolError as exc:
        assert len(exc.sqlstate) == 5
        # The decoder stays broken with a RemoteProtocolError, never anything else.
        with pytest.raises(RemoteProtocolError):
            decoder.next_event()


@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_remote_errors(data: bytes) -> None:
    _hostile(FrontendDecoder(max_message_len=100), data)
    _hostile(BackendDecoder(max_message_len=100), data)
    started = FrontendDecoder(max_message_len=100)
    started.receive_data(m.encode(m.StartupMessage({"user": "x"})))
    assert isinstance(started.next_event(), m.StartupMessage)
    _hostile(started, data)


@given(st.lists(st.one_of(TAGGED_FRONTEND, BACKEND), min_size=1, max_size=4), st.data())
def test_mutated_valid_streams_only_raise_remote_errors(
    msgs: list[m.Message], data: st.DataObject
) -> None:
    raw = bytearray(m.encode(*msgs))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    _hostile(BackendDecoder(), bytes(raw))
    f = FrontendDecoder()
    f.receive_data(m.encode(m.StartupMessage({})))
    f.next_event()
    _hostile(f, bytes(raw))


def test_unknown_tag() -> None:
    d = BackendDecoder()
    d.receive_data(b"?\x00\x00\x00\x04")
    with pytest.raises(RemoteProtocolError, match="unknown server message tag") as info:
        d.next_event()
    assert info.value.sqlstate == "08P01"


def test_oversized_length_rejected_before_body_arrives() -> None:
    d = BackendDecoder(max_message_len=1000)
    d.receive_data(b"d" + struct.pack("!I", 1001))
    with pytest.raises(RemoteProtocolError, match="length 1001"):
        d.next_event()
    f = FrontendDecoder()
    f.receive_data(m.encode(m.StartupMessage({})) + b"S" + struct.pack("!I", SMALL_MESSAGE_LIMIT + 1))
    f.next_event()
    with pytest.raises(RemoteProtocolError, match="Sync message length"):
        f.next_event()


@pytest.mark.parametrize("length", [0, 3, 7, MAX_STARTUP_PACKET_LEN + 1])
def test_bad_startup_length(length: int) -> None:
    d = FrontendDecoder()
    d.receive_data(struct.pack("!II", length, m.PROTOCOL_VERSION_3))
    with pytest.raises(RemoteProtocolError, match="startup packet length"):
        d.next_event()


def test_bad_length_word_below_four() -> None:
    d = BackendDecoder()
    d.receive_data(b"Z\x00\x00\x00\x03")
    with pytest.raises(RemoteProtocolError, match="length 3"):
        d.next_event()


def test_trailing_bytes_inside_message_rejected() -> None:
    d = BackendDecoder()
    d.receive_data(b"Z\x00\x00\x00\x06II")
    with pytest.raises(RemoteProtocolError, match="trailing"):
        d.next_event()


def test_unsupported_protocol_version() -> None:
    d = FrontendDecoder()
    d.receive_data(m.encode(m.StartupMessage({"user": "u"}, protocol_version=2 << 16)))
    with pytest.raises(RemoteProtocolError, match=r"unsupported frontend protocol 2\.0") as info:
        d.next_event()
    assert info.value.sqlstate == "0A000"


def test_unsupported_auth_method_named() -> None:
    d = BackendDecoder()
    d.receive_data(b"R\x00\x00\x00\x08\x00\x00\x00\x07")
    with pytest.raises(RemoteProtocolError, match="GSS"):
        d.next_event()


def test_eof_handling() -> None:
    d = BackendDecoder()
    d.receive_data(m.encode(m.ReadyForQuery("I")))
    d.receive_data(b"")
    assert d.next_event() == m.ReadyForQuery("I")
    assert d.next_event() is CLOSED
    d.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        d.receive_data(b"x")


def test_golden_bytes() -> None:
    # Byte-exact against the layouts in protocols.md §0.
    assert m.encode(m.CopyBothResponse()) == b"W\x00\x00\x00\x07\x00\x00\x00"
    assert m.encode(m.CopyInResponse(1)) == b"G\x00\x00\x00\x07\x01\x00\x00"
    assert m.encode(m.CopyDone()) == b"c\x00\x00\x00\x04"
    assert m.encode(m.AuthenticationOk()) == b"R\x00\x00\x00\x08\x00\x00\x00\x00"
    assert m.encode(m.ReadyForQuery()) == b"Z\x00\x00\x00\x05I"
    assert m.encode(m.SSLRequest()) == b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    assert m.encode(m.DataRow((b"ab", None))) == b"D\x00\x00\x00\x10\x00\x02\x00\x00\x00\x02ab\xff\xff\xff\xff"
    assert m.encode_copy_data(b"xyz") == m.encode(m.CopyData(b"xyz"))
    out = bytearray()
    m.append_copy_data(out, b"a")
    m.append_copy_data(out, memoryview(b"bc"))
    assert bytes(out) == m.encode(m.CopyData(b"a"), m.CopyData(b"bc"))


def test_error_response_accessors() -> None:
    err = m.ErrorResponse.build("boom", "57P01", severity="FATAL", detail="d")
    assert (err.severity, err.sqlstate, err.message, err.detail, err.hint) == ("FATAL", "57P01", "boom", "d", "")


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("", {}),
        ("-c tenant_id=abc timeline_id=def", {"tenant_id": "abc", "timeline_id": "def"}),
        ("-c neon.compute_mode=primary", {"neon.compute_mode": "primary"}),
        ("-cwork_mem=4MB --search-path=x", {"work_mem": "4MB", "search_path": "x"}),
        (r"-c a=has\ space", {"a": "has space"}),
    ],
)
def test_parse_options(options: str, expected: dict[str, str]) -> None:
    assert m.StartupMessage({"options": options}).options == expected


@pytest.mark.parametrize("options", ["-c", "-d 5", "novalue", "a=b\\"])
def test_parse_options_rejects(options: str) -> None:
    with pytest.raises(RemoteProtocolError):
        m.parse_options(options)


# -- the CopyData fast path (copy_data_views) -----------------------------------------------


def _drain_with_views(decoder: FrontendDecoder, limit: int) -> list[object]:
    """Like ``drain`` but CopyData through ``copy_data_views`` (as m.CopyData for comparing)."""
    out: list[object] = []
    while True:
        views = decoder.copy_data_views(limit)
        if views:
            assert all(isinstance(v, memoryview) for v in views)
            out += [m.CopyData(bytes(v)) for v in views]
            continue
        ev = decoder.next_event()
        if ev is NEED_DATA or ev is CLOSED:
            return out
        out.append(ev)


@given(
    st.lists(TAGGED_FRONTEND, max_size=10),
    st.data(),
    st.integers(min_value=1, max_value=4),
)
def test_copy_data_views_agree_with_next_event(
    msgs: list[m.FrontendMessage], data: st.DataObject, limit: int
) -> None:
    """Same messages, in the same order, for any segmentation; CopyData payloads as views."""
    stream = m.encode(m.StartupMessage({}), *msgs)
    decoder = FrontendDecoder()
    # Before the StartupMessage the fast path never frames anything.
    decoder.receive_data(stream)
    assert decoder.copy_data_views() == []
    decoder = FrontendDecoder()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    got: list[object] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        if cut > prev:
            decoder.receive_data(stream[prev:cut])
        got += _drain_with_views(decoder, limit)
        prev = cut
    assert got == [m.StartupMessage({}), *msgs]


# Frame-shaped garbage: mostly CopyData tags, lengths that may or may not match the bodies.
_FRAMEISH = st.lists(
    st.tuples(st.sampled_from(b"ddddcSHQX"), st.integers(0, 160), st.binary(max_size=150)),
    max_size=6,
).map(lambda frames: b"".join(bytes([t]) + n.to_bytes(4, "big") + body for t, n, body in frames))


@given(st.one_of(st.binary(max_size=200), _FRAMEISH), st.integers(min_value=5, max_value=120))
def test_copy_data_views_on_hostile_bytes_fail_like_next_event(data: bytes, max_len: int) -> None:
    """Whatever the bytes, the fast path plus next_event yields the same messages and the
    same error (type and text) as next_event alone."""

    def run(use_views: bool) -> tuple[list[object], str | None]:
        d = FrontendDecoder(max_message_len=max_len)
        d.receive_data(m.encode(m.StartupMessage({"user": "x"})))
        d.next_event()
        d.receive_data(data)
        d.receive_data(b"")
        out: list[object] = []
        try:
            while True:
                if use_views:
                    out += [m.CopyData(bytes(v)) for v in d.copy_data_views()]
                ev = d.next_event()
                if ev is CLOSED:
                    return out, None
                assert ev is not NEED_DATA
                out.append(ev)
        except RemoteProtocolError as exc:
            return out, f"{exc.sqlstate} {exc.msg}"

    assert run(True) == run(False)
