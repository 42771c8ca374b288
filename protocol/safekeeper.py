"""Walproposer <-> safekeeper (proposer <-> acceptor) messages, protocol v3 and v2.

This module owns every byte of the consensus sub-protocol that runs inside CopyData after
``START_WAL_PUSH`` (protocols.md §3.2-3.4): one CopyData payload is exactly one message.

- **v3** (the default): big-endian, a 1-byte ASCII tag, no padding, membership configuration.
- **v2** (legacy): the C structs as the walproposer laid them out, little-endian, the tag widened
  to a u64; there is no membership generation (it decodes as 0) and a few fields exist only here
  (``proposer_id``, ``tli``, ``timeline_start_lsn``, ``term_start_lsn``). They are kept on the
  shared message classes with neutral defaults so one class serves both versions.
- **PageserverFeedback** is always big-endian key/value, even inside a v2 AppendResponse.

Entry points: ``decode_proposer_message`` / ``decode_acceptor_message`` (payload -> message) and
``encode_message(msg, version)`` (message -> payload). Every peer fault raises
``RemoteProtocolError`` with SQLSTATE XX000, which is what a safekeeper sends before closing the
stream (protocols.md §3.5). AppendRequest keeps its WAL as a ``memoryview`` into the payload it
was decoded from, so the caller must not mutate that buffer while the message is alive.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any, Final, Literal, ParamSpec, TypeAlias, TypeVar

import attrs

from protocol.buffer import Reader
from protocol.errors import INTERNAL_ERROR, LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn

ProtocolVersion: TypeAlias = Literal[2, 3]
PROTOCOL_VERSIONS: Final = (2, 3)

MAX_SEND_SIZE: Final = 16 * 8192
ZERO_UUID: Final = bytes(16)

TAG_GREETING: Final = ord("g")
TAG_VOTE: Final = ord("v")
TAG_ELECTED: Final = ord("e")
TAG_APPEND: Final = ord("a")

Bytes: TypeAlias = bytes | bytearray | memoryview
P = ParamSpec("P")
R = TypeVar("R")


def _fail(msg: str) -> RemoteProtocolError:
    return RemoteProtocolError(msg, sqlstate=INTERNAL_ERROR)


class _Cursor:
    """``protocol.buffer.Reader`` with the name of each field read in its error messages."""

    __slots__ = ("_data", "reader")

    def __init__(self, data: Bytes) -> None:
        self._data = data
        self.reader = Reader(data, "safekeeper message")

    def rewind(self) -> None:
        self.reader = Reader(self._data, "safekeeper message")

    @property
    def remaining(self) -> int:
        return self.reader.remaining

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        self.reader.what = what
        return self.reader.unpack(st)

    def take(self, n: int, what: str) -> memoryview:
        self.reader.what = what
        return self.reader.view(n)

    def cstr(self, what: str) -> str:
        self.reader.what = what
        return self.reader.cstr()


def _peer_fault(func: Callable[P, R]) -> Callable[P, R]:
    """Every decoding fault of a safekeeper message is XX000: the safekeeper answers any
    parse error with ErrorResponse XX000 before closing the stream (protocols.md §3.5)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except RemoteProtocolError as exc:
            if exc.sqlstate == INTERNAL_ERROR:
                raise
            raise RemoteProtocolError(exc.msg, sqlstate=INTERNAL_ERROR) from None

    return wrapper


def _put_cstr(buf: bytearray, text: str) -> None:
    raw = text.encode("utf-8")
    if b"\0" in raw:
        raise LocalProtocolError(f"string {text!r} contains NUL")
    buf += raw
    buf += b"\0"


# ---------------------------------------------------------------------------------------------
# Shared pieces

_BE_U8 = struct.Struct(">B")
_BE_U32 = struct.Struct(">I")
_BE_I32 = struct.Struct(">i")
_BE_U64 = struct.Struct(">Q")
_BE_I64 = struct.Struct(">q")
_BE_TERM_ENTRY = struct.Struct(">QQ")
_BE_MEMBER_HEAD = struct.Struct(">Q")
_BE_U16 = struct.Struct(">H")
_LE_TERM_ENTRY = struct.Struct("<QQ")
_LE_U32 = struct.Struct("<I")
_LE_U64 = struct.Struct("<Q")

# A term history longer than this cannot come from a sane proposer; it bounds allocation.
MAX_TERM_HISTORY: Final = 1 << 16
MAX_MEMBERS: Final = 1 << 10


@attrs.frozen
class TermSwitchEntry:
    """The proposer of ``term`` started writing at ``lsn``."""

    term: int
    lsn: Lsn


@attrs.frozen
class SafekeeperId:
    """One member of a membership configuration."""

    node_id: int
    host: str
    pg_port: int


@attrs.frozen
class MembershipConfiguration:
    """Generation 0 means membership is not in use (then no members are needed)."""

    generation: int = 0
    members: tuple[SafekeeperId, ...] = ()
    new_members: tuple[SafekeeperId, ...] | None = None


EMPTY_MCONF: Final = MembershipConfiguration()


def _decode_members(cur: _Cursor) -> tuple[SafekeeperId, ...]:
    (n,) = cur.unpack(_BE_U32, "member count")
    if n > MAX_MEMBERS or n * 11 > cur.remaining:
        raise _fail(f"implausible member count {n}")
    members = []
    for _ in range(n):
        (node_id,) = cur.unpack(_BE_MEMBER_HEAD, "member")
        host = cur.cstr("member host")
        (port,) = cur.unpack(_BE_U16, "member port")
        members.append(SafekeeperId(node_id, host, port))
    return tuple(members)


def _encode_members(buf: bytearray, members: tuple[SafekeeperId, ...]) -> None:
    buf += _BE_U32.pack(len(members))
    for m in members:
        buf += _BE_U64.pack(m.node_id)
        _put_cstr(buf, m.host)
        buf += _BE_U16.pack(m.pg_port)


def decode_mconf(cur: _Cursor) -> MembershipConfiguration:
    (generation,) = cur.unpack(_BE_U32, "membership generation")
    members = _decode_members(cur)
    new_members = _decode_members(cur)
    if generation != 0 and not members:
        raise _fail(f"membership generation {generation} without members")
    return MembershipConfiguration(generation, members, new_members or None)


def encode_mconf(buf: bytearray, mconf: MembershipConfiguration) -> None:
    buf += _BE_U32.pack(mconf.generation)
    _encode_members(buf, mconf.members)
    # The wire cannot tell "no joint config" from "joint config with zero new members".
    _encode_members(buf, mconf.new_members or ())


def _decode_history(cur: _Cursor, entry: struct.Struct, count: struct.Struct) -> tuple[TermSwitchEntry, ...]:
    (n,) = cur.unpack(count, "term history length")
    if n > MAX_TERM_HISTORY or n * entry.size > cur.remaining:
        raise _fail(f"implausible term history length {n}")
    out = []
    for _ in range(n):
        term, lsn = cur.unpack(entry, "term history entry")
        out.append(TermSwitchEntry(term, Lsn(lsn)))
    return tuple(out)


def _encode_history(
    buf: bytearray, history: tuple[TermSwitchEntry, ...], entry: struct.Struct, count: struct.Struct
) -> None:
    buf += count.pack(len(history))
    for e in history:
        buf += entry.pack(e.term, e.lsn)


# ---------------------------------------------------------------------------------------------
# PageserverFeedback (§3.4): nkeys u8, then {key cstr, len i32 BE, value}

FEEDBACK_KEY_ALIASES: Final = {
    "current_timeline_size": "current_timeline_size",
    "ps_writelsn": "last_received_lsn",
    "last_received_lsn": "last_received_lsn",
    "ps_flushlsn": "disk_consistent_lsn",
    "disk_consistent_lsn": "disk_consistent_lsn",
    "ps_applylsn": "remote_consistent_lsn",
    "remote_consistent_lsn": "remote_consistent_lsn",
    "ps_replytime": "replytime",
}


@attrs.frozen
class PageserverFeedback:
    """What a pageserver tells the safekeepers (and they the walproposer) about its progress.

    ``replytime`` is microseconds since 2000-01-01 (PostgreSQL's TimestampTz).
    """

    current_timeline_size: int = 0
    last_received_lsn: Lsn = INVALID_LSN
    disk_consistent_lsn: Lsn = INVALID_LSN
    remote_consistent_lsn: Lsn = INVALID_LSN
    replytime: int = 0
    shard_number: int = 0
    corruption_detected: bool = False

    def encode(self, buf: bytearray) -> None:
        nkeys = 5 + (self.shard_number > 0) + self.corruption_detected
        buf += _BE_U8.pack(nkeys)
        for key, value in (
            ("current_timeline_size", _BE_U64.pack(self.current_timeline_size)),
            ("ps_writelsn", _BE_U64.pack(self.last_received_lsn)),
            ("ps_flushlsn", _BE_U64.pack(self.disk_consistent_lsn)),
            ("ps_applylsn", _BE_U64.pack(self.remote_consistent_lsn)),
            ("ps_replytime", _BE_I64.pack(self.replytime)),
        ):
            _put_kv(buf, key, value)
        if self.shard_number > 0:
            _put_kv(buf, "shard_number", _BE_U32.pack(self.shard_number))
        if self.corruption_detected:
            _put_kv(buf, "corruption_detected", b"\x01")

    def to_bytes(self) -> bytes:
        buf = bytearray()
        self.encode(buf)
        return bytes(buf)

    @classmethod
    def decode(cls, data: Bytes) -> PageserverFeedback:
        return _decode_feedback_blob(data)


def _put_kv(buf: bytearray, key: str, value: bytes) -> None:
    _put_cstr(buf, key)
    buf += _BE_I32.pack(len(value))
    buf += value


@_peer_fault
def _decode_feedback_blob(data: Bytes) -> PageserverFeedback:
    return decode_feedback(_Cursor(data))


def decode_feedback(cur: _Cursor) -> PageserverFeedback:
    (nkeys,) = cur.unpack(_BE_U8, "feedback key count")
    fields: dict[str, int | bool] = {}
    for _ in range(nkeys):
        key = cur.cstr("feedback key")
        (length,) = cur.unpack(_BE_I32, "feedback value length")
        value = cur.take(length, f"feedback value {key!r}")
        name = FEEDBACK_KEY_ALIASES.get(key)
        if name is not None:
            if length != 8:
                raise _fail(f"feedback key {key!r} has length {length}, expected 8")
            (fields[name],) = (_BE_I64 if name == "replytime" else _BE_U64).unpack(value)
        elif key == "shard_number":
            if length != 4:
                raise _fail(f"feedback key {key!r} has length {length}, expected 4")
            (fields["shard_number"],) = _BE_U32.unpack(value)
        elif key == "corruption_detected":
            if length != 1:
                raise _fail(f"feedback key {key!r} has length {length}, expected 1")
            fields["corruption_detected"] = value[0] != 0
        # Unknown keys are skipped by length: newer pageservers may add keys.
    return PageserverFeedback(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Proposer -> acceptor


@attrs.frozen
class ProposerGreeting:
    """First message of a START_WAL_PUSH stream.

    v2 only: ``proposer_id`` (16 raw bytes), ``tli``; v3 only: ``mconf``.
    """

    tenant_id: TenantId
    timeline_id: TimelineId
    pg_version: int
    system_id: int
    wal_seg_size: int
    mconf: MembershipConfiguration = EMPTY_MCONF
    proposer_id: bytes = ZERO_UUID
    tli: int = 1


@attrs.frozen
class VoteRequest:
    """Ask for a vote for ``term``. v2 also carries an (ignored) ``proposer_id``."""

    term: int
    generation: int = 0
    proposer_id: bytes = ZERO_UUID


@attrs.frozen
class ProposerElected:
    """The elected proposer's term history; the acceptor truncates at ``start_streaming_at``."""

    term: int
    start_streaming_at: Lsn
    term_history: tuple[TermSwitchEntry, ...]
    generation: int = 0
    timeline_start_lsn: Lsn = INVALID_LSN  # v2 only, ignored by acceptors


@attrs.frozen
class AppendRequest:
    """WAL bytes [begin_lsn, end_lsn); ``wal`` is a view into the decoded payload, not a copy."""

    term: int
    begin_lsn: Lsn
    end_lsn: Lsn
    commit_lsn: Lsn
    truncate_lsn: Lsn
    wal: bytes | memoryview = attrs.field(eq=bytes, repr=False)
    generation: int = 0
    term_start_lsn: Lsn = INVALID_LSN  # v2 only (the walproposer sends 0)
    proposer_id: bytes = ZERO_UUID  # v2 only
    # How many wire messages this request stands for: more than 1 for a run of continuing
    # appends decoded as one (protocol.append_runs); not on the wire, not compared.
    messages: int = attrs.field(default=1, eq=False)

    @property
    def wal_bytes(self) -> bytes:
        return bytes(self.wal)


ProposerMessage: TypeAlias = ProposerGreeting | VoteRequest | ProposerElected | AppendRequest

# ---------------------------------------------------------------------------------------------
# Acceptor -> proposer


@attrs.frozen
class AcceptorGreeting:
    """Reply to ProposerGreeting; v2 has no mconf."""

    node_id: int
    term: int
    mconf: MembershipConfiguration = EMPTY_MCONF


@attrs.frozen
class VoteResponse:
    """The acceptor's vote and its WAL position; the term history is cut at ``flush_lsn``."""

    term: int
    vote_given: bool
    flush_lsn: Lsn
    truncate_lsn: Lsn
    term_history: tuple[TermSwitchEntry, ...]
    generation: int = 0
    timeline_start_lsn: Lsn = INVALID_LSN  # v2 only (sent as 0)


@attrs.frozen
class AppendResponse:
    """Flush/commit position and aggregated hot-standby feedback, plus pageserver feedback."""

    term: int
    flush_lsn: Lsn
    commit_lsn: Lsn
    hs_ts: int = 0
    hs_xmin: int = 0
    hs_catalog_xmin: int = 0
    pageserver_feedback: PageserverFeedback | None = None
    generation: int = 0


AcceptorMessage: TypeAlias = AcceptorGreeting | VoteResponse | AppendResponse
Message: TypeAlias = ProposerMessage | AcceptorMessage

# ---------------------------------------------------------------------------------------------
# v3 layouts (BE). Each header struct starts with the 1-byte tag.

_V3_GREETING_TAIL = struct.Struct(">IQI")  # pg_version, system_id, wal_seg_size
_V3_VOTE_REQ = struct.Struct(">BIQ")
_V3_ELECTED_HEAD = struct.Struct(">BIQQ")
_V3_APPEND_REQ = struct.Struct(">BIQQQQQ")
_V3_ACC_GREETING_HEAD = struct.Struct(">BQ")
_V3_VOTE_RESP_HEAD = struct.Struct(">BIQBQQ")
_V3_APPEND_RESP = struct.Struct(">BIQQQqQQ")

# v2 layouts (LE, tag u64)
_V2_GREETING = struct.Struct("<QII16sQ16s16sII")
_V2_VOTE_REQ = struct.Struct("<QQ16s")
_V2_ELECTED_HEAD = struct.Struct("<QQQ")
_V2_APPEND_REQ = struct.Struct("<QQQQQQQ16s")
_V2_ACC_GREETING = struct.Struct("<QQQ")
_V2_VOTE_RESP_HEAD = struct.Struct("<QQQQQ")
_V2_APPEND_RESP = struct.Struct("<QQQQqQQ")

V2_GREETING_SIZE: Final = _V2_GREETING.size
V2_APPEND_HEADER_SIZE: Final = _V2_APPEND_REQ.size
V3_APPEND_HEADER_SIZE: Final = _V3_APPEND_REQ.size


def _check_version(version: int) -> None:
    if version not in PROTOCOL_VERSIONS:
        raise LocalProtocolError(f"unsupported safekeeper protocol version {version}")


def _read_tag(cur: _Cursor, version: int) -> int:
    if version == 3:
        (tag,) = cur.unpack(_BE_U8, "message tag")
    else:
        (tag,) = cur.unpack(_LE_U64, "message tag")
    return int(tag)


def _check_wal_len(begin: int, end: int) -> int:
    if end < begin:
        raise _fail(f"AppendRequest end_lsn {end:X} before begin_lsn {begin:X}")
    if end - begin > MAX_SEND_SIZE:
        raise _fail(f"AppendRequest carries {end - begin} bytes, more than {MAX_SEND_SIZE}")
    return end - begin


_V3_APPEND_UNPACK = _V3_APPEND_REQ.unpack_from


def decode_proposer_message(data: Bytes, version: ProtocolVersion) -> ProposerMessage:
    """Decode one CopyData payload a walproposer sent. Trailing bytes are ignored (as neon).

    A well-formed v3 AppendRequest, nearly every message of a push stream, takes a fast path:
    one precompiled ``unpack_from`` of the header and a memoryview of the WAL (no copy, no
    cursor, no error-wrapping frame). Anything else, malformed appends included, goes through
    the general decoder, so errors are the same either way."""
    if version == 3 and len(data) >= V3_APPEND_HEADER_SIZE and data[0] == TAG_APPEND:
        _, gen, term, begin, end, commit, trunc = _V3_APPEND_UNPACK(data, 0)
        stop = V3_APPEND_HEADER_SIZE + end - begin
        if begin <= end and end - begin <= MAX_SEND_SIZE and len(data) >= stop:
            # The unpacked fields are plain ints; Lsn is a NewType, so no conversion is due.
            wal = memoryview(data)[V3_APPEND_HEADER_SIZE:stop]
            return AppendRequest(term, begin, end, commit, trunc, wal, generation=gen)
    return _decode_proposer_message(data, version)


@_peer_fault
def _decode_proposer_message(data: Bytes, version: ProtocolVersion) -> ProposerMessage:
    _check_version(version)
    cur = _Cursor(data)
    tag = _read_tag(cur, version)
    cur.rewind()
    if version == 3:
        if tag == TAG_GREETING:
            _read_tag(cur, version)
            tenant = TenantId.parse(cur.cstr("tenant_id"))
            timeline = TimelineId.parse(cur.cstr("timeline_id"))
            mconf = decode_mconf(cur)
            pg_version, system_id, seg = cur.unpack(_V3_GREETING_TAIL, "ProposerGreeting")
            return ProposerGreeting(tenant, timeline, pg_version, system_id, seg, mconf=mconf)
        if tag == TAG_VOTE:
            _, gen, term = cur.unpack(_V3_VOTE_REQ, "VoteRequest")
            return VoteRequest(term, generation=gen)
        if tag == TAG_ELECTED:
            _, gen, term, start = cur.unpack(_V3_ELECTED_HEAD, "ProposerElected")
            history = _decode_history(cur, _BE_TERM_ENTRY, _BE_U32)
            return ProposerElected(term, Lsn(start), history, generation=gen)
        if tag == TAG_APPEND:
            _, gen, term, begin, end, commit, trunc = cur.unpack(_V3_APPEND_REQ, "AppendRequest")
            wal = cur.take(_check_wal_len(begin, end), "AppendRequest WAL")
            return AppendRequest(
                term, Lsn(begin), Lsn(end), Lsn(commit), Lsn(trunc), wal, generation=gen
            )
    else:
        if tag == TAG_GREETING:
            (_, proto, pg_version, proposer_id, system_id, timeline, tenant, tli, seg) = (
                cur.unpack(_V2_GREETING, "ProposerGreeting")
            )
            if proto != 2:
                raise _fail(f"v2 ProposerGreeting claims protocol version {proto}")
            return ProposerGreeting(
                TenantId(bytes(tenant)),
                TimelineId(bytes(timeline)),
                pg_version,
                system_id,
                seg,
                proposer_id=bytes(proposer_id),
                tli=tli,
            )
        if tag == TAG_VOTE:
            _, term, proposer_id = cur.unpack(_V2_VOTE_REQ, "VoteRequest")
            return VoteRequest(term, proposer_id=bytes(proposer_id))
        if tag == TAG_ELECTED:
            _, term, start = cur.unpack(_V2_ELECTED_HEAD, "ProposerElected")
            history = _decode_history(cur, _LE_TERM_ENTRY, _LE_U32)
            (tl_start,) = cur.unpack(_LE_U64, "ProposerElected timeline_start_lsn")
            return ProposerElected(term, Lsn(start), history, timeline_start_lsn=Lsn(tl_start))
        if tag == TAG_APPEND:
            (_, term, term_start, begin, end, commit, trunc, proposer_id) = cur.unpack(
                _V2_APPEND_REQ, "AppendRequest"
            )
            wal = cur.take(_check_wal_len(begin, end), "AppendRequest WAL")
            return AppendRequest(
                term,
                Lsn(begin),
                Lsn(end),
                Lsn(commit),
                Lsn(trunc),
                wal,
                term_start_lsn=Lsn(term_start),
                proposer_id=bytes(proposer_id),
            )
    raise _fail(f"unknown proposer message tag {tag:#x} (protocol v{version})")


@_peer_fault
def decode_acceptor_message(data: Bytes, version: ProtocolVersion) -> AcceptorMessage:
    """Decode one CopyData payload a safekeeper sent to the walproposer."""
    _check_version(version)
    cur = _Cursor(data)
    tag = _read_tag(cur, version)
    if version == 3:
        if tag == TAG_GREETING:
            (node_id,) = cur.unpack(_BE_U64, "AcceptorGreeting")
            mconf = decode_mconf(cur)
            (term,) = cur.unpack(_BE_U64, "AcceptorGreeting term")
            return AcceptorGreeting(node_id, term, mconf)
        if tag == TAG_VOTE:
            cur.rewind()
            _, gen, term, given, flush, trunc = cur.unpack(_V3_VOTE_RESP_HEAD, "VoteResponse")
            history = _decode_history(cur, _BE_TERM_ENTRY, _BE_U32)
            return VoteResponse(term, given != 0, Lsn(flush), Lsn(trunc), history, generation=gen)
        if tag == TAG_APPEND:
            cur.rewind()
            _, gen, term, flush, commit, ts, xmin, cxmin = cur.unpack(
                _V3_APPEND_RESP, "AppendResponse"
            )
            fb = decode_feedback(cur) if cur.remaining else None
            return AppendResponse(
                term, Lsn(flush), Lsn(commit), ts, xmin, cxmin, fb, generation=gen
            )
    else:
        cur.rewind()
        if tag == TAG_GREETING:
            _, term, node_id = cur.unpack(_V2_ACC_GREETING, "AcceptorGreeting")
            return AcceptorGreeting(node_id, term)
        if tag == TAG_VOTE:
            _, term, given, flush, trunc = cur.unpack(_V2_VOTE_RESP_HEAD, "VoteResponse")
            history = _decode_history(cur, _LE_TERM_ENTRY, _LE_U32)
            (tl_start,) = cur.unpack(_LE_U64, "VoteResponse timeline_start_lsn")
            return VoteResponse(
                term, given != 0, Lsn(flush), Lsn(trunc), history, timeline_start_lsn=Lsn(tl_start)
            )
        if tag == TAG_APPEND:
            _, term, flush, commit, ts, xmin, cxmin = cur.unpack(_V2_APPEND_RESP, "AppendResponse")
            fb = decode_feedback(cur) if cur.remaining else None
            return AppendResponse(term, Lsn(flush), Lsn(commit), ts, xmin, cxmin, fb)
    raise _fail(f"unknown acceptor message tag {tag:#x} (protocol v{version})")


def encode_append_request_header(msg: AppendRequest, version: ProtocolVersion) -> bytes:
    """The AppendRequest header alone, so a sender can write header and WAL without a copy."""
    _check_version(version)
    if len(msg.wal) != msg.end_lsn - msg.begin_lsn:
        raise LocalProtocolError(
            f"AppendRequest WAL is {len(msg.wal)} bytes but the range is "
            f"{msg.end_lsn - msg.begin_lsn}"
        )
    if version == 3:
        return _V3_APPEND_REQ.pack(
            TAG_APPEND,
            msg.generation,
            msg.term,
            msg.begin_lsn,
            msg.end_lsn,
            msg.commit_lsn,
            msg.truncate_lsn,
        )
    return _V2_APPEND_REQ.pack(
        TAG_APPEND,
        msg.term,
        msg.term_start_lsn,
        msg.begin_lsn,
        msg.end_lsn,
        msg.commit_lsn,
        msg.truncate_lsn,
        msg.proposer_id,
    )


def encode_message(msg: Message, version: ProtocolVersion) -> bytes:
    """Encode one message (either direction) as one CopyData payload."""
    buf = bytearray()
    encode_message_into(buf, msg, version)
    return bytes(buf)


def encode_message_into(buf: bytearray, msg: Message, version: ProtocolVersion) -> None:
    _check_version(version)
    v3 = version == 3
    if not v3 and getattr(msg, "generation", 0) != 0:
        raise LocalProtocolError("protocol v2 has no membership generation")
    match msg:
        case ProposerGreeting():
            if v3:
                buf += _BE_U8.pack(TAG_GREETING)
                _put_cstr(buf, msg.tenant_id.hex)
                _put_cstr(buf, msg.timeline_id.hex)
                encode_mconf(buf, msg.mconf)
                buf += _V3_GREETING_TAIL.pack(msg.pg_version, msg.system_id, msg.wal_seg_size)
            else:
                if msg.mconf != EMPTY_MCONF:
                    raise LocalProtocolError("protocol v2 has no membership configuration")
                buf += _V2_GREETING.pack(
                    TAG_GREETING,
                    2,
                    msg.pg_version,
                    msg.proposer_id,
                    msg.system_id,
                    msg.timeline_id.raw,
                    msg.tenant_id.raw,
                    msg.tli,
                    msg.wal_seg_size,
                )
        case VoteRequest():
            if v3:
                buf += _V3_VOTE_REQ.pack(TAG_VOTE, msg.generation, msg.term)
            else:
                buf += _V2_VOTE_REQ.pack(TAG_VOTE, msg.term, msg.proposer_id)
        case ProposerElected():
            if v3:
                buf += _V3_ELECTED_HEAD.pack(
                    TAG_ELECTED, msg.generation, msg.term, msg.start_streaming_at
                )
                _encode_history(buf, msg.term_history, _BE_TERM_ENTRY, _BE_U32)
            else:
                buf += _V2_ELECTED_HEAD.pack(TAG_ELECTED, msg.term, msg.start_streaming_at)
                _encode_history(buf, msg.term_history, _LE_TERM_ENTRY, _LE_U32)
                buf += _LE_U64.pack(msg.timeline_start_lsn)
        case AppendRequest():
            buf += encode_append_request_header(msg, version)
            buf += msg.wal
        case AcceptorGreeting():
            if v3:
                buf += _V3_ACC_GREETING_HEAD.pack(TAG_GREETING, msg.node_id)
                encode_mconf(buf, msg.mconf)
                buf += _BE_U64.pack(msg.term)
            else:
                if msg.mconf != EMPTY_MCONF:
                    raise LocalProtocolError("protocol v2 has no membership configuration")
                buf += _V2_ACC_GREETING.pack(TAG_GREETING, msg.term, msg.node_id)
        case VoteResponse():
            if v3:
                buf += _V3_VOTE_RESP_HEAD.pack(
                    TAG_VOTE,
                    msg.generation,
                    msg.term,
                    int(msg.vote_given),
                    msg.flush_lsn,
                    msg.truncate_lsn,
                )
                _encode_history(buf, msg.term_history, _BE_TERM_ENTRY, _BE_U32)
            else:
                buf += _V2_VOTE_RESP_HEAD.pack(
                    TAG_VOTE, msg.term, int(msg.vote_given), msg.flush_lsn, msg.truncate_lsn
                )
                _encode_history(buf, msg.term_history, _LE_TERM_ENTRY, _LE_U32)
                buf += _LE_U64.pack(msg.timeline_start_lsn)
        case AppendResponse():
            if v3:
                buf += _V3_APPEND_RESP.pack(
                    TAG_APPEND,
                    msg.generation,
                    msg.term,
                    msg.flush_lsn,
                    msg.commit_lsn,
                    msg.hs_ts,
                    msg.hs_xmin,
                    msg.hs_catalog_xmin,
                )
            else:
                buf += _V2_APPEND_RESP.pack(
                    TAG_APPEND,
                    msg.term,
                    msg.flush_lsn,
                    msg.commit_lsn,
                    msg.hs_ts,
                    msg.hs_xmin,
                    msg.hs_catalog_xmin,
                )
            if msg.pageserver_feedback is not None:
                msg.pageserver_feedback.encode(buf)
        case _:
            raise LocalProtocolError(f"not a safekeeper message: {msg!r}")
