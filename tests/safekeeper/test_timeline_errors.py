"""Timeline write paths under proposer errors: invalid WAL in a group that a non-append
message ends is reported as the proposer's error, once, after the valid prefix is flushed."""

from __future__ import annotations

from pathlib import Path

from protocol.lsn import INVALID_LSN, Lsn
from protocol.safekeeper import (
    AppendRequest,
    AppendResponse,
    VoteRequest,
)
from safekeeper.record_tracker import InvalidWal
from safekeeper.testing import synthetic_wal
from tests.safekeeper.conftest import START, SYSTEM_ID, elected_timeline


async def test_invalid_wal_before_a_non_append_is_the_proposers_error(tmp_path: Path) -> None:
    tl = await elected_timeline(tmp_path / "tl", no_sync=True)
    wal = bytearray(synthetic_wal(START, 16384, system_id=SYSTEM_ID))
    half = 8192
    wal[half + 2000] ^= 0x40  # damage a record of the second AppendRequest
    good = AppendRequest(1, START, Lsn(START + half), INVALID_LSN, INVALID_LSN, bytes(wal[:half]))
    bad = AppendRequest(
        1, Lsn(START + half), Lsn(START + len(wal)), INVALID_LSN, INVALID_LSN, bytes(wal[half:])
    )
    # The non-append after them ends the group inside the loop (written before it).
    replies, error = await tl.process_batch([good, bad, VoteRequest(1)])
    assert isinstance(error, InvalidWal)
    flushed = tl.acceptor.flush_lsn
    assert START + half - 200 < flushed <= START + half
    assert tl.storage.write_lsn == flushed
    # The valid prefix is acknowledged.
    assert any(isinstance(r, AppendResponse) and r.flush_lsn == flushed for r in replies)
