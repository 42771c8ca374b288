"""The wal-acceptor benchmark's floor receivers measure what they claim: the ``-crc`` floors
check every record exactly like the safekeeper's tracker, and every floor acknowledges the
whole stream (a floor that dropped bytes or skipped checks would flatter the ceiling)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.wal_acceptor import (
    FLOORS_FSYNC,
    FLOORS_NO_FSYNC,
    _FrameFeeder,
    framed_stream,
    run_floor,
    segment_template,
)
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from safekeeper.record_tracker import InvalidWal

START = Lsn(WAL_SEGMENT_SIZE)


@pytest.fixture(scope="module")
def stream() -> tuple[bytes, Lsn]:
    return framed_stream(segment_template(8000), 1, 2 << 20, 128 * 1024, True)


@pytest.mark.parametrize("piece", [1, 45, 7777, 1 << 20])
def test_crc_floor_checks_every_record_in_any_segmentation(
    stream: tuple[bytes, Lsn], piece: int
) -> None:
    data, end = stream
    view = memoryview(data)[: 300_000 if piece == 1 else len(data)]
    feeder = _FrameFeeder(START)
    for k in range(0, len(view), piece):
        feeder.feed(view[k : k + piece])
    if piece != 1:
        assert end - 8192 < feeder.tracker.record_end <= end
    bad = bytearray(data)
    bad[len(bad) // 2 + 1000] ^= 0x10  # inside a record, past the framing
    feeder = _FrameFeeder(START)
    with pytest.raises(InvalidWal):
        for k in range(0, len(bad), piece if piece > 1 else 4096):
            feeder.feed(memoryview(bad)[k : k + (piece if piece > 1 else 4096)])


@pytest.mark.parametrize("mode", sorted({*FLOORS_FSYNC, *FLOORS_NO_FSYNC}))
async def test_every_floor_acknowledges_the_whole_stream(
    tmp_path: Path, stream: tuple[bytes, Lsn], mode: str
) -> None:
    data, end = stream
    result = await run_floor(tmp_path / "floor", mode, data, START, end - START, 128 * 1024, 30.0)
    assert result["acked_mib"] == round((end - START) / (1 << 20), 2)
    assert float(result["mib_s"]) > 0  # type: ignore[arg-type]
