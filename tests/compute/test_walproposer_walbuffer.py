"""The bridge's WAL window: appends in order, overlap skipping, trimming, reads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compute.walproposer.walbuffer import WalBuffer, WalNotBuffered
from protocol.errors import LocalProtocolError
from protocol.lsn import Lsn

START = Lsn(0x1_0000_0000 - 100)  # crosses a 4 GiB boundary: LSN math must not wrap


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60)), max_size=40),
    st.integers(2, 300),
    st.data(),
)
def test_window_matches_stream(chunks: list[tuple[int, int]], capacity: int, data: st.DataObject) -> None:
    stream = bytes(range(256)) * 40
    buf = WalBuffer(START, capacity)
    pos = 0
    for back, size in chunks:
        # Resend up to ``back`` bytes we already have, like a reconnected sender would.
        begin = max(0, pos - back)
        piece = stream[begin : begin + size]
        buf.append(Lsn(START + begin), piece)
        pos = max(pos, begin + len(piece))
        assert buf.end == START + pos
        assert len(buf) <= capacity
        lo = buf.start - START
        at = data.draw(st.integers(lo, pos))
        n = data.draw(st.integers(0, 100))
        assert buf.read(Lsn(START + at), n) == stream[at : min(at + n, pos)]
    if buf.start > START:
        with pytest.raises(WalNotBuffered):
            buf.read(Lsn(buf.start - 1), 1)


def test_gap_and_read_past_end_are_errors() -> None:
    buf = WalBuffer(START)
    buf.append(START, b"abc")
    with pytest.raises(LocalProtocolError):
        buf.append(Lsn(START + 4), b"x")
    with pytest.raises(LocalProtocolError):
        buf.read(Lsn(START + 4), 1)
    assert buf.read(Lsn(START + 3), 10) == b""


def test_trim_and_reset() -> None:
    buf = WalBuffer(START)
    buf.append(START, b"0123456789")
    buf.trim(Lsn(START + 4))
    assert buf.start == START + 4 and buf.read(buf.start, 3) == b"456"
    buf.trim(Lsn(START + 100))  # clamped to the end
    assert buf.start == buf.end == START + 10
    buf.reset(Lsn(5))
    assert (buf.start, buf.end, len(buf)) == (5, 5, 0)
