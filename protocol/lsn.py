"""Log sequence numbers: PostgreSQL's byte positions in the WAL.

``Lsn`` is a ``NewType`` over ``int`` so it costs nothing at run time and mypy still keeps
it apart from block numbers and lengths. The text form is PostgreSQL's ``X/Y``: upper-case hex
halves without padding. Segment helpers assume the default 16 MiB segment and 8 KiB WAL page
unless told otherwise, and timeline (TLI) 1.
"""

from __future__ import annotations

import re
from typing import NewType

from protocol.errors import RemoteProtocolError

Lsn = NewType("Lsn", int)

INVALID_LSN = Lsn(0)
MAX_LSN = Lsn(0xFFFF_FFFF_FFFF_FFFF)
WAL_SEGMENT_SIZE = 16 * 1024 * 1024
XLOG_BLCKSZ = 8192
MAXALIGN = 8


# Only hex digits, as pg_lsn_in: ``int(x, 16)`` alone would also take a sign ("-1/0" gave a
# negative LSN), a "0x" prefix, underscores and inner whitespace.
_LSN_TEXT = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_SEGMENT_NAME = re.compile(r"([0-9A-F]{8})([0-9A-F]{8})([0-9A-F]{8})(?:\.partial)?")


def parse_lsn(text: str) -> Lsn:
    """Parse ``X/Y``; a malformed value is the peer's fault."""
    m = _LSN_TEXT.fullmatch(text.strip())
    if m is None:
        raise RemoteProtocolError(f"invalid LSN {text!r}: expected X/Y in hex")
    return Lsn((int(m[1], 16) << 32) | int(m[2], 16))


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFF_FFFF:X}"


def lsn_add(lsn: Lsn, delta: int) -> Lsn:
    result = lsn + delta
    if not 0 <= result <= MAX_LSN:
        raise OverflowError(f"LSN arithmetic out of range: {format_lsn(lsn)} + {delta}")
    return Lsn(result)


def align_up(lsn: int, alignment: int = MAXALIGN) -> Lsn:
    return Lsn((lsn + alignment - 1) & ~(alignment - 1))


def align_down(lsn: int, alignment: int = MAXALIGN) -> Lsn:
    return Lsn(lsn & ~(alignment - 1))


def segment_number(lsn: int, segment_size: int = WAL_SEGMENT_SIZE) -> int:
    return lsn // segment_size


def segment_offset(lsn: int, segment_size: int = WAL_SEGMENT_SIZE) -> int:
    return lsn % segment_size


def segment_start(segno: int, segment_size: int = WAL_SEGMENT_SIZE) -> Lsn:
    return Lsn(segno * segment_size)


def segment_file_name(segno: int, timeline: int = 1, segment_size: int = WAL_SEGMENT_SIZE) -> str:
    """PostgreSQL's ``XLogFileName``: TLI, then the segment number split in log id and seg."""
    per_id = 0x1_0000_0000 // segment_size
    return f"{timeline:08X}{segno // per_id:08X}{segno % per_id:08X}"


def parse_segment_file_name(name: str, segment_size: int = WAL_SEGMENT_SIZE) -> tuple[int, int]:
    """Inverse of ``segment_file_name`` (``.partial`` allowed): returns (timeline, segno).

    As PostgreSQL's ``IsXLogFileName``: upper-case hex only; the low part must also be a
    segment that exists at this segment size, or two names would map to one segment number.
    """
    m = _SEGMENT_NAME.fullmatch(name)
    per_id = 0x1_0000_0000 // segment_size
    if m is None or int(m[3], 16) >= per_id:
        raise ValueError(f"not a WAL segment file name: {name!r}")
    return int(m[1], 16), int(m[2], 16) * per_id + int(m[3], 16)


def page_offset(lsn: int, page_size: int = XLOG_BLCKSZ) -> int:
    """Offset of ``lsn`` inside its WAL page."""
    return lsn % page_size


def page_start(lsn: int, page_size: int = XLOG_BLCKSZ) -> Lsn:
    return Lsn(lsn - lsn % page_size)
