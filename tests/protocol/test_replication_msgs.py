"""Physical replication CopyData messages and replication command parsing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn
from protocol.pgwire.sqlstate import SYNTAX_ERROR
from protocol.replication import (
    CopyMessage,
    CreateReplicationSlot,
    HotStandbyFeedback,
    IdentifySystem,
    NeonFeedback,
    PrimaryKeepalive,
    ReadReplicationSlot,
    ReplicationCommand,
    SetCommand,
    Show,
    StandbyStatusUpdate,
    StartReplication,
    StartWalPush,
    TimelineHistory,
    TimelineStatus,
    XLogData,
    decode_client_copy_data,
    decode_server_copy_data,
    encode_copy_message,
    parse_replication_command,
)
from protocol.safekeeper import PageserverFeedback
from tests.strategies import i64, lsns, u32, u64

feedbacks = st.builds(PageserverFeedback, u64, lsns, lsns, lsns, i64, u32, st.booleans())

server_msgs = st.one_of(
    st.builds(XLogData, lsns, lsns, i64, st.binary(max_size=200)),
    st.builds(PrimaryKeepalive, lsns, i64, st.booleans()),
)
client_msgs = st.one_of(
    st.builds(StandbyStatusUpdate, lsns, lsns, lsns, i64, st.booleans()),
    st.builds(HotStandbyFeedback, i64, u32, u32, u32, u32),
    st.builds(NeonFeedback, feedbacks),
)


@given(server_msgs)
def test_server_message_round_trip(msg: CopyMessage) -> None:
    assert decode_server_copy_data(encode_copy_message(msg)) == msg


@given(client_msgs)
def test_client_message_round_trip(msg: CopyMessage) -> None:
    assert decode_client_copy_data(encode_copy_message(msg)) == msg


def test_golden_bytes() -> None:
    xlog = XLogData(Lsn(0x1000000), Lsn(0x1000010), 5, b"\x01\x02")
    assert encode_copy_message(xlog) == b"w" + struct.pack(">QQq", 0x1000000, 0x1000010, 5) + b"\x01\x02"
    decoded = decode_server_copy_data(encode_copy_message(xlog))
    assert isinstance(decoded, XLogData) and isinstance(decoded.data, memoryview)
    assert encode_copy_message(PrimaryKeepalive(Lsn(7), 9, True)) == b"k" + struct.pack(">Qq", 7, 9) + b"\x01"
    status = StandbyStatusUpdate(Lsn(1), Lsn(2), Lsn(3), 4, False)
    assert encode_copy_message(status) == b"r" + struct.pack(">QQQq", 1, 2, 3, 4) + b"\x00"
    assert len(encode_copy_message(HotStandbyFeedback(1, 2, 3, 4, 5))) == 1 + 8 + 16
    z = encode_copy_message(NeonFeedback(PageserverFeedback()))
    assert z[0:1] == b"z" and struct.unpack(">Q", z[1:9])[0] == len(z) - 9


@given(st.binary(max_size=80))
def test_hostile_copy_data(data: bytes) -> None:
    for decode in (decode_server_copy_data, decode_client_copy_data):
        try:
            decode(data)
        except RemoteProtocolError:
            pass


@given(server_msgs | client_msgs, st.data())
def test_truncated_copy_data(msg: CopyMessage, data: st.DataObject) -> None:
    raw = encode_copy_message(msg)
    if isinstance(msg, XLogData):
        raw = raw[:25]  # the WAL tail is open-ended; truncate inside the header
    cut = data.draw(st.integers(0, len(raw) - 1))
    decode = decode_server_copy_data if isinstance(msg, XLogData | PrimaryKeepalive) else decode_client_copy_data
    with pytest.raises(RemoteProtocolError):
        decode(raw[:cut])


slot_names = st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True)
commands = st.one_of(
    st.just(IdentifySystem()),
    st.just(TimelineStatus()),
    st.builds(
        StartReplication,
        lsns,
        slot=st.none() | slot_names,
        physical=st.booleans(),
        timeline=st.none() | u32,
        term=st.none() | u64,
    ),
    st.builds(TimelineHistory, u32),
    st.builds(Show, slot_names),
    st.builds(StartWalPush, st.sampled_from([2, 3]), st.booleans()),
    st.builds(CreateReplicationSlot, slot_names, st.booleans(), st.booleans()),
    st.builds(ReadReplicationSlot, slot_names),
)


@given(commands)
def test_command_round_trip(cmd: ReplicationCommand) -> None:
    assert parse_replication_command(cmd.to_sql()) == cmd


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("IDENTIFY_SYSTEM", IdentifySystem()),
        ("identify_system;", IdentifySystem()),
        ("START_REPLICATION PHYSICAL 0/16ABCDE", StartReplication(Lsn(0x16ABCDE))),
        (
            "START_REPLICATION SLOT s1 PHYSICAL 1/0 TIMELINE 1",
            StartReplication(Lsn(1 << 32), slot="s1", timeline=1),
        ),
        ("START_REPLICATION 0/0", StartReplication(Lsn(0), physical=False)),
        ("START_REPLICATION PHYSICAL 0/10 (term='5')", StartReplication(Lsn(16), term=5)),
        ("START_WAL_PUSH", StartWalPush(2, True)),
        (
            "START_WAL_PUSH (proto_version '3', allow_timeline_creation 'false')",
            StartWalPush(3, False),
        ),
        ("START_WAL_PUSH (proto_version '3', future_key 'x')", StartWalPush(3, True)),
        ("TIMELINE_HISTORY 2", TimelineHistory(2)),
        ("SHOW wal_segment_size", Show("wal_segment_size")),
        ("CREATE_REPLICATION_SLOT s TEMPORARY PHYSICAL RESERVE_WAL", CreateReplicationSlot("s", True, True)),
        ("CREATE_REPLICATION_SLOT s PHYSICAL (RESERVE_WAL)", CreateReplicationSlot("s", False, True)),
        ("READ_REPLICATION_SLOT s", ReadReplicationSlot("s")),
        ("set datestyle to 'ISO'", SetCommand("set datestyle to 'ISO'")),
        ("TIMELINE_STATUS", TimelineStatus()),
    ],
)
def test_parse_known_commands(text: str, expected: ReplicationCommand) -> None:
    assert parse_replication_command(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "SELECT 1",
        "IDENTIFY_SYSTEM extra",
        "START_REPLICATION",
        "START_REPLICATION PHYSICAL zz/1",
        "START_REPLICATION PHYSICAL 123456789/0",
        "START_REPLICATION PHYSICAL 0/1 TIMELINE x",
        "TIMELINE_HISTORY",
        "TIMELINE_HISTORY 99999999999",
        "SHOW",
        "SHOW a b",
        "START_WAL_PUSH (proto_version '7')",
        "START_WAL_PUSH (allow_timeline_creation 'maybe')",
        "START_WAL_PUSH garbage",
        "CREATE_REPLICATION_SLOT s PHYSICAL BOGUS",
        "CREATE_REPLICATION_SLOT",
        "READ_REPLICATION_SLOT",
    ],
)
def test_garbage_commands_are_syntax_errors(text: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_replication_command(text)
    assert info.value.sqlstate == SYNTAX_ERROR


def test_logical_is_refused_as_unsupported() -> None:
    for text in ("CREATE_REPLICATION_SLOT s LOGICAL pgoutput", "START_REPLICATION SLOT s LOGICAL 0/0"):
        with pytest.raises(RemoteProtocolError) as info:
            parse_replication_command(text)
        assert info.value.sqlstate == "0A000"


@given(st.text(max_size=80))
def test_hostile_command_text(text: str) -> None:
    try:
        parse_replication_command(text)
    except RemoteProtocolError:
        pass


@given(st.sampled_from(["START_REPLICATION ", "START_WAL_PUSH ", "CREATE_REPLICATION_SLOT ", "SHOW ", "TIMELINE_HISTORY "]), st.text(max_size=60))
def test_hostile_command_arguments(prefix: str, tail: str) -> None:
    try:
        parse_replication_command(prefix + tail)
    except RemoteProtocolError:
        pass
