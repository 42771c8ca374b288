"""PostgreSQL physical replication: CopyData messages and the replication commands' text.

This module owns (protocols.md §3.1, §3.6; PostgreSQL's protocol-replication docs):

- the messages inside CopyData on a replication connection, all big-endian:
  server -> client XLogData ``'w'`` and primary keepalive ``'k'``;
  client -> server standby status update ``'r'``, hot standby feedback ``'h'`` and neon's
  pageserver feedback ``'z'`` (``'z'``, u64 length, PageserverFeedback blob);
- parsing the replication commands a walsender-like server accepts (``IDENTIFY_SYSTEM``,
  ``START_REPLICATION``, ``TIMELINE_HISTORY``, ``SHOW``, ``START_WAL_PUSH``,
  ``CREATE_REPLICATION_SLOT ... PHYSICAL``, ``READ_REPLICATION_SLOT``, ``TIMELINE_STATUS``,
  ``SET ...``) into attrs values, and rendering them back to text for clients.

Malformed CopyData raises ``RemoteProtocolError`` (08P01); a malformed command raises it with
SQLSTATE 42601 (syntax error), as PostgreSQL's replication grammar does. XLogData keeps its WAL
as a ``memoryview`` into the decoded payload. Timestamps are PostgreSQL's TimestampTz
(microseconds since 2000-01-01): ``pg_now``.
"""

from __future__ import annotations

import re
import struct
import time
from typing import Final, TypeAlias

import attrs

from protocol.errors import PROTOCOL_VIOLATION, LocalProtocolError, RemoteProtocolError
from protocol.lsn import Lsn, format_lsn, parse_lsn
from protocol.pgwire.sqlstate import FEATURE_NOT_SUPPORTED, SYNTAX_ERROR
from protocol.safekeeper import PageserverFeedback

Bytes: TypeAlias = bytes | bytearray | memoryview

PG_EPOCH_OFFSET_S: Final = 946_684_800  # 2000-01-01 in Unix seconds


def pg_now() -> int:
    """PostgreSQL's TimestampTz for now: microseconds since 2000-01-01."""
    return int((time.time() - PG_EPOCH_OFFSET_S) * 1_000_000)

# ---------------------------------------------------------------------------------------------
# CopyData messages

_XLOG_DATA = struct.Struct(">cQQq")
_KEEPALIVE = struct.Struct(">cQqB")
_STANDBY_STATUS = struct.Struct(">cQQQqB")
_HOT_STANDBY = struct.Struct(">cqIIII")
_NEON_FEEDBACK_HEAD = struct.Struct(">cQ")

XLOG_DATA_HEADER_SIZE: Final = _XLOG_DATA.size


@attrs.frozen
class XLogData:
    """WAL bytes starting at ``wal_start``; ``wal_end`` is the server's current end of WAL."""

    wal_start: Lsn
    wal_end: Lsn
    timestamp: int  # microseconds since 2000-01-01
    data: bytes | memoryview = attrs.field(eq=bytes, repr=False)

    def header(self) -> bytes:
        """The 25-byte header alone, so a sender can write header and WAL without a copy."""
        return _XLOG_DATA.pack(b"w", self.wal_start, self.wal_end, self.timestamp)


@attrs.frozen
class PrimaryKeepalive:
    wal_end: Lsn
    timestamp: int
    reply_requested: bool


@attrs.frozen
class StandbyStatusUpdate:
    write_lsn: Lsn
    flush_lsn: Lsn
    apply_lsn: Lsn
    timestamp: int
    reply_requested: bool


@attrs.frozen
class HotStandbyFeedback:
    timestamp: int
    xmin: int
    xmin_epoch: int
    catalog_xmin: int
    catalog_xmin_epoch: int


@attrs.frozen
class NeonFeedback:
    """``'z'``: a pageserver's feedback to a safekeeper on the replication stream."""

    feedback: PageserverFeedback


ServerCopyMessage: TypeAlias = XLogData | PrimaryKeepalive
ClientCopyMessage: TypeAlias = StandbyStatusUpdate | HotStandbyFeedback | NeonFeedback
CopyMessage: TypeAlias = ServerCopyMessage | ClientCopyMessage


def _bad(msg: str) -> RemoteProtocolError:
    return RemoteProtocolError(msg, sqlstate=PROTOCOL_VIOLATION)


def _view(data: Bytes) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _need(view: memoryview, st: struct.Struct, what: str) -> None:
    if len(view) < st.size:
        raise _bad(f"truncated {what}: {len(view)} bytes, need {st.size}")


def decode_server_copy_data(data: Bytes) -> ServerCopyMessage:
    """Decode one CopyData payload a walsender sent (XLogData or keepalive)."""
    view = _view(data)
    if not view:
        raise _bad("empty replication CopyData")
    tag = view[0]
    if tag == ord("w"):
        _need(view, _XLOG_DATA, "XLogData")
        _, start, end, ts = _XLOG_DATA.unpack_from(view)
        return XLogData(Lsn(start), Lsn(end), ts, view[_XLOG_DATA.size :])
    if tag == ord("k"):
        _need(view, _KEEPALIVE, "keepalive")
        _, end, ts, reply = _KEEPALIVE.unpack_from(view)
        return PrimaryKeepalive(Lsn(end), ts, reply != 0)
    raise _bad(f"unknown replication message tag {tag:#x} from server")


def decode_client_copy_data(data: Bytes) -> ClientCopyMessage:
    """Decode one CopyData payload a replication client sent ('r', 'h' or 'z')."""
    view = _view(data)
    if not view:
        raise _bad("empty replication CopyData")
    tag = view[0]
    if tag == ord("r"):
        _need(view, _STANDBY_STATUS, "standby status update")
        _, write, flush, apply, ts, reply = _STANDBY_STATUS.unpack_from(view)
        return StandbyStatusUpdate(Lsn(write), Lsn(flush), Lsn(apply), ts, reply != 0)
    if tag == ord("h"):
        _need(view, _HOT_STANDBY, "hot standby feedback")
        _, ts, xmin, epoch, cxmin, cepoch = _HOT_STANDBY.unpack_from(view)
        return HotStandbyFeedback(ts, xmin, epoch, cxmin, cepoch)
    if tag == ord("z"):
        _need(view, _NEON_FEEDBACK_HEAD, "neon feedback")
        # The length field is informational (the safekeeper skips it); parse the rest.
        return NeonFeedback(PageserverFeedback.decode(view[_NEON_FEEDBACK_HEAD.size :]))
    raise _bad(f"unknown replication message tag {tag:#x} from client")


def encode_copy_message(msg: CopyMessage) -> bytes:
    """One CopyData payload for ``msg`` (either direction)."""
    match msg:
        case XLogData():
            return msg.header() + bytes(msg.data)
        case PrimaryKeepalive():
            return _KEEPALIVE.pack(b"k", msg.wal_end, msg.timestamp, int(msg.reply_requested))
        case StandbyStatusUpdate():
            return _STANDBY_STATUS.pack(
                b"r",
                msg.write_lsn,
                msg.flush_lsn,
                msg.apply_lsn,
                msg.timestamp,
                int(msg.reply_requested),
            )
        case HotStandbyFeedback():
            return _HOT_STANDBY.pack(
                b"h",
                msg.timestamp,
                msg.xmin,
                msg.xmin_epoch,
                msg.catalog_xmin,
                msg.catalog_xmin_epoch,
            )
        case NeonFeedback():
            blob = msg.feedback.to_bytes()
            return _NEON_FEEDBACK_HEAD.pack(b"z", len(blob)) + blob
        case _:
            raise LocalProtocolError(f"not a replication message: {msg!r}")


# ---------------------------------------------------------------------------------------------
# Replication commands (simple Query text on a replication connection)


@attrs.frozen
class IdentifySystem:
    def to_sql(self) -> str:
        return "IDENTIFY_SYSTEM"


@attrs.frozen
class TimelineStatus:
    def to_sql(self) -> str:
        return "TIMELINE_STATUS"


@attrs.frozen
class StartReplication:
    """``START_REPLICATION [SLOT s] [PHYSICAL] X/Y [TIMELINE n] [(term='N')]``.

    ``term`` is neon's extension: stream up to flush_lsn while the safekeeper's term is N.
    """

    start_lsn: Lsn
    slot: str | None = None
    physical: bool = True
    timeline: int | None = None
    term: int | None = None

    def to_sql(self) -> str:
        parts = ["START_REPLICATION"]
        if self.slot is not None:
            parts += ["SLOT", self.slot]
        if self.physical:
            parts.append("PHYSICAL")
        parts.append(format_lsn(self.start_lsn))
        if self.timeline is not None:
            parts += ["TIMELINE", str(self.timeline)]
        if self.term is not None:
            parts.append(f"(term='{self.term}')")
        return " ".join(parts)


@attrs.frozen
class TimelineHistory:
    timeline: int

    def to_sql(self) -> str:
        return f"TIMELINE_HISTORY {self.timeline}"


@attrs.frozen
class Show:
    name: str

    def to_sql(self) -> str:
        return f"SHOW {self.name}"


@attrs.frozen
class StartWalPush:
    """``START_WAL_PUSH [(proto_version '3', allow_timeline_creation 'true')]``.

    Absent options mean proto_version 2 and allow_timeline_creation true (protocols.md §3.1).
    """

    proto_version: int = 2
    allow_timeline_creation: bool = True

    def to_sql(self) -> str:
        creation = "true" if self.allow_timeline_creation else "false"
        return (
            f"START_WAL_PUSH (proto_version '{self.proto_version}', "
            f"allow_timeline_creation '{creation}')"
        )


@attrs.frozen
class CreateReplicationSlot:
    """``CREATE_REPLICATION_SLOT name [TEMPORARY] PHYSICAL [RESERVE_WAL]`` (physical only)."""

    slot: str
    temporary: bool = False
    reserve_wal: bool = False

    def to_sql(self) -> str:
        parts = ["CREATE_REPLICATION_SLOT", self.slot]
        if self.temporary:
            parts.append("TEMPORARY")
        parts.append("PHYSICAL")
        if self.reserve_wal:
            parts.append("RESERVE_WAL")
        return " ".join(parts)


@attrs.frozen
class ReadReplicationSlot:
    slot: str

    def to_sql(self) -> str:
        return f"READ_REPLICATION_SLOT {self.slot}"


@attrs.frozen
class SetCommand:
    """``SET ...``: clients (psycopg's datestyle) send it; servers answer ``SELECT 1``."""

    text: str

    def to_sql(self) -> str:
        return self.text


ReplicationCommand: TypeAlias = (
    IdentifySystem
    | TimelineStatus
    | StartReplication
    | TimelineHistory
    | Show
    | StartWalPush
    | CreateReplicationSlot
    | ReadReplicationSlot
    | SetCommand
)

_IDENT = r"[A-Za-z_][A-Za-z0-9_$]*"
_IDENT_RE = re.compile(_IDENT + r"\Z", re.ASCII)
_LSN_TEXT = r"[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}"
_START_REPLICATION_RE = re.compile(
    rf"START_REPLICATION(?:\s+SLOT\s+(?P<slot>{_IDENT}|\"[^\"]+\"))?(?P<physical>\s+PHYSICAL)?"
    rf"\s+(?P<lsn>{_LSN_TEXT})(?:\s+TIMELINE\s+(?P<tli>\d{{1,10}}))?"
    rf"(?:\s*\(\s*term\s*=\s*'(?P<term>\d{{1,20}})'\s*\))?\s*;?\s*\Z",
    re.IGNORECASE | re.ASCII,
)
_START_WAL_PUSH_RE = re.compile(r"START_WAL_PUSH(?:\s*\((?P<opts>[^()]*)\))?\s*;?\s*\Z", re.I | re.A)
_CREATE_SLOT_RE = re.compile(
    rf"CREATE_REPLICATION_SLOT\s+(?P<slot>{_IDENT})(?P<temp>\s+TEMPORARY)?\s+(?P<kind>\w+)"
    r"(?P<rest>(?:\s+\w+)*|\s*\([^()]*\))\s*;?\s*\Z",
    re.IGNORECASE | re.ASCII,
)


def _syntax(text: str, why: str = "") -> RemoteProtocolError:
    detail = f": {why}" if why else ""
    return RemoteProtocolError(
        f"syntax error in replication command {text[:200]!r}{detail}", sqlstate=SYNTAX_ERROR
    )


def _u32(text: str, value: str) -> int:
    number = int(value)
    if number > 0xFFFF_FFFF:
        raise _syntax(text, f"{value} out of range")
    return number


def _parse_wal_push_options(text: str, opts: str) -> StartWalPush:
    proto_version = 2
    allow_creation = True
    for item in opts.split(","):
        if not item.strip():
            continue
        key, _, value = item.strip().partition(" ")
        value = value.strip().strip("'\"")
        key = key.strip().lower()
        if key == "proto_version":
            if value not in ("2", "3"):
                raise _syntax(text, f"unsupported proto_version {value!r}")
            proto_version = int(value)
        elif key == "allow_timeline_creation":
            if value.lower() not in ("true", "false"):
                raise _syntax(text, f"allow_timeline_creation must be true or false, not {value!r}")
            allow_creation = value.lower() == "true"
        # Unknown keys are ignored, as the safekeeper does.
    return StartWalPush(proto_version, allow_creation)


def parse_replication_command(query: str) -> ReplicationCommand:
    """Parse one replication command; anything else is a 42601 syntax error."""
    text = query.strip()
    if not text:
        raise _syntax(text, "empty query")
    word, *tail = text.split(None, 1)
    word = word.rstrip(";").upper()
    rest = tail[0].strip().rstrip(";").strip() if tail else ""
    if word == "IDENTIFY_SYSTEM" and not rest:
        return IdentifySystem()
    if word == "TIMELINE_STATUS" and not rest:
        return TimelineStatus()
    if word == "SET":
        if not rest:
            raise _syntax(text, "SET needs an argument")
        return SetCommand(text)
    if word == "START_REPLICATION":
        if " LOGICAL " in f" {text.upper()} ":
            raise RemoteProtocolError(
                "logical replication is not supported", sqlstate=FEATURE_NOT_SUPPORTED
            )
        m = _START_REPLICATION_RE.match(text)
        if m is None:
            raise _syntax(text)
        slot = m["slot"]
        if slot is not None and slot.startswith('"'):
            slot = slot[1:-1]
        try:
            lsn = parse_lsn(m["lsn"])
        except RemoteProtocolError:
            raise _syntax(text, "bad LSN") from None
        return StartReplication(
            lsn,
            slot=slot,
            physical=m["physical"] is not None,
            timeline=None if m["tli"] is None else _u32(text, m["tli"]),
            term=None if m["term"] is None else int(m["term"]),
        )
    if word == "TIMELINE_HISTORY":
        if not (rest.isascii() and rest.isdigit()) or len(rest) > 10:
            raise _syntax(text, "TIMELINE_HISTORY needs a timeline number")
        return TimelineHistory(_u32(text, rest))
    if word == "SHOW":
        if not _IDENT_RE.match(rest):
            raise _syntax(text, "SHOW needs a parameter name")
        return Show(rest.lower())
    if word == "START_WAL_PUSH":
        m = _START_WAL_PUSH_RE.match(text)
        if m is None:
            raise _syntax(text)
        return _parse_wal_push_options(text, m["opts"] or "")
    if word == "CREATE_REPLICATION_SLOT":
        m = _CREATE_SLOT_RE.match(text)
        if m is None:
            raise _syntax(text)
        kind = m["kind"].upper()
        if kind == "LOGICAL":
            raise RemoteProtocolError(
                "logical replication slots are not supported", sqlstate=FEATURE_NOT_SUPPORTED
            )
        if kind != "PHYSICAL":
            raise _syntax(text, f"expected PHYSICAL, got {m['kind']!r}")
        options = [o.upper() for o in re.findall(r"\w+", m["rest"])]
        if any(o != "RESERVE_WAL" for o in options):
            raise _syntax(text, f"unknown slot options {m['rest'].strip()!r}")
        return CreateReplicationSlot(
            m["slot"], temporary=m["temp"] is not None, reserve_wal=bool(options)
        )
    if word == "READ_REPLICATION_SLOT":
        if not _IDENT_RE.match(rest):
            raise _syntax(text, "READ_REPLICATION_SLOT needs a slot name")
        return ReadReplicationSlot(rest)
    raise _syntax(text, "unknown replication command")
