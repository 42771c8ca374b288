"""The page header checks both decoder paths share.

PostgreSQL's ``XLogReaderValidatePageHeader`` refuses a long page header whose
``xlp_sysid`` differs from the system identifier it already knows ("WAL file is from
different database system: WAL file database system identifier is X, pg_control database
system identifier is Y"). WAL of another cluster spliced in at a segment boundary (a
misconfigured safekeeper, a recycled segment of another system) must end the WAL there, on
the general path (``next_record``) and on the crossing-record path (``crossing_record``).
"""

from __future__ import annotations

import struct

from protocol.lsn import Lsn
from protocol.wal.encoder import WalEncoder
from protocol.wal.reader import EndOfWal, WalStreamDecoder
from protocol.wal.rmgr import RmgrId

SEG = 1 << 20  # a small segment size keeps the WAL short
START = SEG + 40  # just after segment 1's long header


def _wal_over_three_segments() -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    enc = WalEncoder(START, prev_lsn=START - 100, segment_size=SEG)
    spans = []
    while enc.insert_lsn < 3 * SEG + 50_000:
        spans.append(enc.append(RmgrId.STANDBY, 0x00, main_data=bytes(3000)))  # (not XLOG: crossing_record refuses those)
    return bytes(enc.take()), spans


def _with_sysid_at(wal: bytes, seg_start: int, sysid: int) -> bytes:
    out = bytearray(wal)
    struct.pack_into("<Q", out, seg_start - START + 24, sysid)  # xlp_sysid of the long header
    return bytes(out)


def test_a_long_header_of_another_system_ends_the_wal() -> None:
    wal, _spans = _wal_over_three_segments()
    # segment 2's header sets the identifier (segment 1's is before the start); segment 3 lies
    bad = _with_sysid_at(wal, 3 * SEG, 0x1234_5678_9ABC_DEF0)
    dec = WalStreamDecoder(START, prev_lsn=START - 100, segment_size=SEG)
    dec.feed(bad)
    got = []
    while True:
        item = dec.next_record()
        if not hasattr(item, "end_lsn"):
            break
        got.append(item)
    stop = dec.finish() if not isinstance(item, EndOfWal) else item
    assert dec.system_identifier == 0x7000_0000_0000_0001
    assert all(r.end_lsn <= 3 * SEG for r in got), "a record read from another system's segment"
    assert isinstance(stop, EndOfWal) and stop.error_lsn == 3 * SEG, stop
    assert "database system identifier" in stop.reason


def test_crossing_record_refuses_a_long_header_of_another_system() -> None:
    wal, spans = _wal_over_three_segments()
    crossing = next(s for s in spans if s[0] < 3 * SEG < s[1])
    for sysid, taken in ((0x7000_0000_0000_0001, True), (0x1234_5678_9ABC_DEF0, False)):
        dec = WalStreamDecoder(START, prev_lsn=START - 100, segment_size=SEG)
        dec.feed(_with_sysid_at(wal, 3 * SEG, sysid))
        while True:
            item = dec.next_record()
            assert not isinstance(item, EndOfWal)
            if item.end_lsn >= crossing[0]:  # type: ignore[union-attr]
                break
        got = dec.crossing_record()
        # (the control, the same WAL untouched, shows the record is one crossing_record gives)
        assert (got is not None and got[1:3] == crossing) if taken else got is None, got
