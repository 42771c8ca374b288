"""The decoder's fast paths (issue 7's ingest speed work) agree with the general code.

- ``decode_body`` parses the common single-block layout (block 0 without image or SAME_REL,
  then a short main data) in one struct unpack: for any bytes of that shape, valid or not, it
  must return exactly what the general fragment parser returns, or fail the same way.
- ``WalStreamDecoder`` keeps fed chunks pending and joins them on the next read: feeding a
  whole stream in many small chunks before reading anything must give the same records as
  reading after every chunk.
- ``WalStreamDecoder.decode_into`` (the receiver's batch path, its own loop for in-page
  records) gives exactly the records ``next_record`` gives, and stops the same way (where
  and why valid WAL ends), on synthetic WAL, corrupted or not; a mutant of it (the simple
  layout's payload offset one off) is caught. tests/pageserver/test_walingest_fast.py does
  the same on real PostgreSQL WAL.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.wal import reader as reader_mod
from protocol.wal import record as record_mod
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode, decode_body
from tests.protocol.wal_strategies import SEG, encode, record_specs, simple_record_specs

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


def _by_next_record(start: int, data: bytes, chunks: list[int]) -> tuple[list[DecodedRecord], object]:
    dec = WalStreamDecoder(start)
    got: list[DecodedRecord] = []
    at = 0
    for size in chunks:
        dec.feed(data[at : at + size])
        at += size
        got.extend(dec.records())
    return got, dec.finish()


def _by_decode_into(start: int, data: bytes, chunks: list[int]) -> tuple[list[DecodedRecord], object]:
    dec = WalStreamDecoder(start)
    got: list[DecodedRecord] = []
    at = 0
    for size in chunks:
        dec.feed(data[at : at + size])
        at += size
        before = len(got)
        stop = dec.decode_into(got)
        assert all(isinstance(r, DecodedRecord) for r in got[before:])
        assert stop is dec.ended or stop is not None
    return got, dec.finish()


def _chunking(data: bytes, sizes: list[int]) -> list[int]:
    out: list[int] = []
    total = 0
    i = 0
    while total < len(data):
        n = sizes[i % len(sizes)]
        out.append(n)
        total += n
        i += 1
    return out


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.one_of(simple_record_specs(), simple_record_specs(), record_specs()), min_size=1, max_size=60),
    sizes=st.lists(st.sampled_from([1, 100, 977, 8192, 20000, 131072]), min_size=1, max_size=4),
    corrupt=st.none() | st.tuples(st.integers(0, 2**31), st.integers(1, 255)),
    page_start=st.booleans(),
)
def test_decode_into_equals_next_record(
    specs: list[dict[str, object]],
    sizes: list[int],
    corrupt: tuple[int, int] | None,
    page_start: bool,
) -> None:
    start = 2 * SEG - 5000 if not page_start else 2 * SEG - 8192  # crosses a segment boundary
    data, spans = encode(start, specs)
    if corrupt is not None:
        where, flip = corrupt
        buf = bytearray(data)
        buf[where % len(buf)] ^= flip
        data = bytes(buf)
    chunks = _chunking(data, sizes)
    want, want_end = _by_next_record(start, data, chunks)
    got, got_end = _by_decode_into(start, data, chunks)
    assert got == want
    assert got_end == want_end
    if corrupt is None:
        assert [(r.lsn, r.end_lsn) for r in got] == spans


def test_decode_into_mutant_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above can fail. A mutant of decode_into that forgets to leave XLOG records
    to the general path reads an XLOG_SWITCH as an ordinary record (the next record then
    seems to follow it, not to start the next segment) and is caught. (A payload offset one
    byte off is not a mutant that survives: the layout's length test then fails and the
    record goes to decode_body.)"""
    def simple(i: int) -> dict[str, object]:
        blk = BlockSpec(rnode=RelFileNode(1663, 5, 16384), blkno=i, data=bytes(range(60)))
        return {"rmid": 10, "info": 0, "xid": 5, "main_data": b"abc", "blocks": [blk]}

    start = 2 * SEG - 30000
    enc = WalEncoder(start)
    for i in range(100):
        enc.append(**simple(i))  # type: ignore[arg-type]
    enc.switch()
    for i in range(100):
        enc.append(**simple(i))  # type: ignore[arg-type]
    data = enc.take()
    chunks = _chunking(data, [131072])
    want, want_end = _by_next_record(start, data, chunks)
    assert len(want) == 201
    fast_blocks = []
    real_new_block = reader_mod._new_block

    def counting_new_block(*args: object) -> object:
        fast_blocks.append(args)
        return real_new_block(*args)

    monkeypatch.setattr(reader_mod, "_new_block", counting_new_block)
    assert _by_decode_into(start, data, chunks) == (want, want_end)
    assert len(fast_blocks) > 150  # the records did go through decode_into's own loop
    monkeypatch.setattr(reader_mod, "_RM_XLOG", -1)
    got, got_end = _by_decode_into(start, data, chunks)
    assert (got, got_end) != (want, want_end)


_PAGE_FIELD_MUTATIONS: list[tuple[str, int, str, int]] = [
    # (name, offset in the short header, struct format, how: xor mask / value to set)
    ("magic", 0, "<H", 0x0001),
    ("contrecord bit", 2, "<H", 0x0001),
    ("long header bit", 2, "<H", 0x0002),
    ("overwrite bit", 2, "<H", 0x0008),
    ("unknown info bit", 2, "<H", 0x0010),
    ("tli lower", 4, "<I", 0x0001),  # 1 -> 0
    ("tli higher", 4, "<I", 0x0002),  # 1 -> 3: a newer timeline is accepted
    ("pageaddr", 8, "<Q", 0x2000),
    ("rem_len", 16, "<I", 0x0008),
]


@pytest.mark.parametrize("mutation", _PAGE_FIELD_MUTATIONS, ids=[m[0] for m in _PAGE_FIELD_MUTATIONS])
def test_decode_into_page_headers_inline_equal_next_record(mutation: tuple[str, int, str, int]) -> None:
    """Every field of a short page header of a bulk load (a record continuing onto the page,
    or none), changed: decode_into ends the WAL exactly where and why next_record ends it (or
    both accept it). (Written for an inline page-header check in decode_into's loop, measured
    at ~1% of the decoder's CPU and not kept; the test guards any such fast path.)"""
    import random

    _name, off, fmt, mask = mutation
    rng = random.Random(7)
    rnode = RelFileNode(1663, 5, 16384)
    start = 2 * SEG - 40 * 8192  # a segment boundary (long header) on the way too
    enc = WalEncoder(start)
    for i in range(3000):
        size = rng.choice([60, 116, 116, 116, 200, 300])
        blk = BlockSpec(rnode=rnode, blkno=i // 50, data=bytes(size))
        enc.append(10, 0, xid=9, blocks=[blk], main_data=b"\x01\x00\x00")
    data = enc.take()
    pages = [p for p in range(8192, len(data), 8192) if (start + p) % SEG]
    with_cont = [p for p in pages if struct.unpack_from("<H", data, p + 2)[0] & 1]
    without = [p for p in pages if not struct.unpack_from("<H", data, p + 2)[0] & 1]
    assert with_cont and without  # both kinds of page are tested
    for page in [with_cont[0], with_cont[len(with_cont) // 2], without[0], without[-1]]:
        buf = bytearray(data)
        (value,) = struct.unpack_from(fmt, buf, page + off)
        struct.pack_into(fmt, buf, page + off, value ^ mask)
        for sizes in ([131072], [977, 100]):
            chunks = _chunking(bytes(buf), sizes)
            want = _by_next_record(start, bytes(buf), chunks)
            assert _by_decode_into(start, bytes(buf), chunks) == want
