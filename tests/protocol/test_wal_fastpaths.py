"""The decoder's fast paths (issue 7's ingest speed work) agree with the general code.

- ``decode_body`` parses the common single-block layout (block 0 without image or SAME_REL,
  then a short main data) in one struct unpack: for any bytes of that shape, valid or not, it
  must return exactly what the general fragment parser returns, or fail the same way.
- ``WalStreamDecoder`` keeps fed chunks pending and joins them on the next read: feeding a
  whole stream in many small chunks before reading anything must give the same records as
  reading after every chunk.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.wal import record as record_mod
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord, decode_body
from tests.protocol.wal_strategies import SEG, encode, record_specs

_HEADER = bytes(24)  # decode_body does not look at the XLogRecord header


@contextmanager
def _general_path_only() -> Iterator[None]:
    saved = record_mod._SIMPLE_PAYLOAD_AT
    record_mod._SIMPLE_PAYLOAD_AT = 1 << 40  # no record is that long: the fast path never runs
    try:
        yield
    finally:
        record_mod._SIMPLE_PAYLOAD_AT = saved


def _outcome(raw: bytes) -> object:
    try:
        return ("ok", decode_body(raw, 0x1000))
    except RemoteProtocolError as exc:
        return ("error", exc.msg)


@settings(max_examples=400, deadline=None)
@given(
    fork_flags=st.integers(0, 255),
    data_len=st.integers(0, 70),
    main_id=st.sampled_from([255, 255, 254, 253, 0, 1]),
    main_len=st.integers(0, 40),
    slack=st.integers(-3, 3),
    fields=st.tuples(*[st.integers(0, 2**32 - 1)] * 4),
    fill=st.binary(min_size=120, max_size=120),
)
def test_simple_layout_fast_path_equals_general(
    fork_flags: int,
    data_len: int,
    main_id: int,
    main_len: int,
    slack: int,
    fields: tuple[int, int, int, int],
    fill: bytes,
) -> None:
    head = struct.pack("<BBH4IBB", 0, fork_flags, data_len, *fields, main_id, main_len)
    payload = fill[: max(0, data_len + main_len + slack)]
    raw = _HEADER + head + payload
    fast = _outcome(raw)
    with _general_path_only():
        general = _outcome(raw)
    assert fast == general


@settings(max_examples=30, deadline=None)
@given(specs=st.lists(record_specs(), min_size=1, max_size=30), chunk=st.integers(1, 3000))
def test_feeding_everything_before_reading(specs: list[dict[str, object]], chunk: int) -> None:
    start = 2 * SEG - 1000  # records cross a segment boundary
    data, spans = encode(start, specs)
    eager = WalStreamDecoder(start)
    lazy = WalStreamDecoder(start)
    got_eager: list[DecodedRecord] = []
    for i in range(0, len(data), chunk):
        piece = bytearray(data[i : i + chunk])
        eager.feed(piece)
        lazy.feed(piece)
        piece[:] = bytes(len(piece))  # the decoder must have copied what it keeps
        got_eager.extend(eager.records())
    got_lazy = list(lazy.records())
    assert [r.raw for r in got_lazy] == [r.raw for r in got_eager]
    assert [r.end_lsn for r in got_lazy] == [r.end_lsn for r in got_eager]
    assert len(got_lazy) == len(specs)
    assert [(r.lsn, r.end_lsn) for r in got_lazy] == spans
    assert lazy.finish() == eager.finish()
