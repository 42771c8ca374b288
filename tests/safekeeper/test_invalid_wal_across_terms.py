"""A deposed proposer's group with invalid WAL, finished only after a new proposer was elected
at the cut and sent WAL, must not take the new proposer's accepted WAL back: the cut's
correction of ``write_lsn`` belongs to the epoch it was made in (the election truncated and
set the acceptor's LSNs itself)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from protocol.lsn import INVALID_LSN, Lsn
from protocol.safekeeper import AppendRequest, ProposerElected, TermSwitchEntry, VoteRequest
from safekeeper.record_tracker import RecordTracker
from safekeeper.testing import synthetic_wal
from tests.safekeeper.conftest import START, SYSTEM_ID, elected_timeline

PIECE = 65536


def _append(term: int, begin: Lsn, wal: bytes | bytearray) -> AppendRequest:
    return AppendRequest(term, begin, Lsn(begin + len(wal)), INVALID_LSN, INVALID_LSN, bytes(wal))


async def test_a_deposed_invalid_group_leaves_the_new_proposers_write_lsn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tl = await elected_timeline(tmp_path / "tl", no_sync=True)
    good = synthetic_wal(START, 3 * PIECE, system_id=SYSTEM_ID)
    bad = bytearray(good)
    bad[PIECE + 30000] ^= 0x40
    cut = Lsn(RecordTracker(START).feed(good[:PIECE]))

    # Proposer A (term 1): group 1 valid and acknowledged; group 2 damaged, not finished yet.
    _, p1, err = await tl.write_appends([_append(1, START, good[:PIECE])])
    assert err is None and p1 is not None
    await tl.finish(p1)
    _, p2, err = await tl.write_appends([_append(1, Lsn(START + PIECE), bad[PIECE : 2 * PIECE])])
    assert err is None and p2 is not None
    await p2.write.finished()
    assert tl.storage.write_lsn == cut

    # Proposer B (term 2) is elected at the cut and sends WAL; its write is held.
    _, err = await tl.process_batch(
        [VoteRequest(2), ProposerElected(2, cut, (TermSwitchEntry(1, START), TermSwitchEntry(2, cut)))]
    )
    assert err is None, err
    gate = threading.Event()
    real = tl.storage.write_group

    def held(*args: Any) -> Any:
        assert gate.wait(10)
        return real(*args)

    monkeypatch.setattr(tl.storage, "write_group", held)
    b_end = Lsn(cut + 1000)
    _, pb, err = await tl.write_appends([_append(2, cut, good[cut - START : b_end - START])])
    assert err is None and pb is not None
    assert tl.acceptor.write_lsn == b_end

    # A's stream finishes its group 2 now: its error is still raised to A...
    await tl.finish(p2)
    assert p2.invalid is not None
    gate.set()
    # ...but B's accepted WAL stays, and B's next append continues from it.
    assert tl.acceptor.write_lsn == b_end
    _, pb2, err = await tl.write_appends(
        [_append(2, b_end, good[b_end - START : b_end - START + 1000])]
    )
    assert err is None, err
    assert pb2 is not None
    await tl.finish(pb)
    await tl.finish(pb2)
    assert tl.acceptor.flush_lsn <= Lsn(b_end + 1000)
    tl.storage.close()
