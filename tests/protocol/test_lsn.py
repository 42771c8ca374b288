"""Lsn text form and WAL segment-name helpers, against PostgreSQL's spelling."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.lsn import (
    Lsn,
    align_up,
    format_lsn,
    page_offset,
    parse_lsn,
    parse_segment_file_name,
    segment_file_name,
    segment_number,
    segment_offset,
)

lsns = st.integers(min_value=0, max_value=2**64 - 1)


@given(lsns)
def test_lsn_text_round_trip(value: int) -> None:
    assert parse_lsn(format_lsn(value)) == value


def test_lsn_format_matches_postgres() -> None:
    assert format_lsn(0x1_6B37_4D48) == "1/6B374D48"
    assert format_lsn(0) == "0/0"
    assert parse_lsn("0/16B3748") == 0x16B3748


@pytest.mark.parametrize(
    "bad",
    # int(x, 16) alone takes signs, 0x prefixes, underscores and inner spaces: "-1/0" was -2**32.
    ["", "1", "/1", "1/", "G/0", "123456789/0", "1/2/3", "-1/0", "0/-1", "+1/0", "0x1/0",
     "1_0/0", "1/ 2", "1 /2", "１/0"],
)
def test_lsn_parse_rejects_garbage(bad: str) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_lsn(bad)


def test_segment_helpers_match_postgres_names() -> None:
    lsn = Lsn(0x1_6B37_4D48)
    segno = segment_number(lsn)
    assert segment_file_name(segno) == "00000001000000010000006B"
    assert segment_offset(lsn) == 0x374D48
    assert page_offset(lsn) == 0x374D48 % 8192
    assert parse_segment_file_name("00000001000000010000006B.partial") == (1, segno)
    assert align_up(0x11) == 0x18


@given(st.integers(min_value=0, max_value=2**40 - 1))
def test_segment_name_round_trip(segno: int) -> None:
    assert parse_segment_file_name(segment_file_name(segno))[1] == segno


@given(st.text(max_size=20))
def test_lsn_parse_is_never_negative_or_out_of_range(text: str) -> None:
    try:
        value = parse_lsn(text)
    except RemoteProtocolError:
        return
    assert 0 <= value <= 2**64 - 1
    assert parse_lsn(format_lsn(value)) == value


@pytest.mark.parametrize(
    "bad",
    ["", "00000001000000010000006", "00000001000000010000006b", "0x000001000000010000006B",
     "+0000001000000010000006B", "000000010000000100000100", "00000001000000010000006B.part",
     "00000001_00000010000006B"],
)
def test_segment_file_name_parse_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="not a WAL segment file name"):
        parse_segment_file_name(bad)
