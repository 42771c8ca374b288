"""A group's flush published on the event loop's thread (``Timeline.finish`` ->
``WalStorage.mark_flushed``) while the WAL IO engine's thread cuts WAL back for the next
group's invalid WAL: the flush must not land over the cut (``flush_lsn`` above ``write_lsn``).

The interleaving is forced, not hoped for: the storage's ``epoch`` read on the event loop's
thread lets the engine's held truncation run right after the read (as a thread switch there
would), and waits for it a bounded time (a lock that keeps the truncation out meanwhile makes
it wait the whole bound, and that is fine)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from protocol.lsn import INVALID_LSN, Lsn
from protocol.safekeeper import AppendRequest
from safekeeper.record_tracker import RecordTracker
from safekeeper.testing import synthetic_wal
from safekeeper.wal_storage import WalStorage
from tests.safekeeper.conftest import START, SYSTEM_ID, elected_timeline, wait_until

PIECE = 65536


class _RacingStorage(WalStorage):
    """``epoch`` as a property: its first read on the armed thread lets the held truncation
    through and gives it up to ``grace`` seconds before returning the value it read."""

    armed_thread: int | None = None
    grace = 0.5
    go = threading.Event()
    truncated = threading.Event()

    @property
    def epoch(self) -> int:
        value: int = self.__dict__["_racing_epoch"]
        if self.armed_thread == threading.get_ident():
            self.armed_thread = None
            self.go.set()
            self.truncated.wait(self.grace)
        return value

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.__dict__["_racing_epoch"] = value


def _append(begin: Lsn, wal: bytes | bytearray) -> AppendRequest:
    return AppendRequest(1, begin, Lsn(begin + len(wal)), INVALID_LSN, INVALID_LSN, bytes(wal))


async def test_a_flush_published_during_an_invalid_wal_cut_stays_below_write_lsn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tl = await elected_timeline(tmp_path / "tl", no_sync=True)
    good = synthetic_wal(START, 2 * PIECE, system_id=SYSTEM_ID)
    bad = bytearray(good)
    # Damage the record that group A's end splits: the cut falls inside A's bytes.
    bad[PIECE + 4] ^= 0x40
    cut = Lsn(RecordTracker(START).feed(good[:PIECE]))
    a_end = Lsn(START + PIECE)
    assert cut < a_end, "group A must end inside a record for the cut to fall below it"

    storage = tl.storage
    state = storage.__dict__.pop("epoch")
    storage.__class__ = _RacingStorage
    racing = storage
    assert isinstance(racing, _RacingStorage)
    racing.epoch = state
    racing.go = threading.Event()
    racing.truncated = threading.Event()
    reached = threading.Event()
    real_truncate = storage.truncate

    def held_truncate(lsn: Lsn) -> None:
        reached.set()
        assert racing.go.wait(10)
        try:
            real_truncate(lsn)
        finally:
            racing.truncated.set()

    monkeypatch.setattr(storage, "truncate", held_truncate)

    # Group A (valid) is written; group B (invalid) is written up to the truncation, held.
    _, pa, err = await tl.write_appends([_append(START, good[:PIECE])])
    assert err is None and pa is not None
    await pa.write.finished()
    _, pb, err = await tl.write_appends([_append(a_end, bad[PIECE : 2 * PIECE])])
    assert err is None and pb is not None
    with trio.fail_after(10):
        await wait_until(reached.is_set)

    # A's flush is published now, with B's cut running right after its epoch check.
    racing.armed_thread = threading.get_ident()
    with trio.fail_after(10):
        await tl.finish(pa)
        await pb.write.finished()
        await tl.finish(pb)
    assert pb.invalid is not None
    assert racing.truncated.is_set()

    assert storage.write_lsn == cut
    assert storage.flush_lsn <= storage.write_lsn, (
        f"flush_lsn {storage.flush_lsn:X} above write_lsn {storage.write_lsn:X}"
    )
    assert storage.flush_record_lsn <= storage.write_lsn
    assert tl.acceptor.flush_record_lsn <= cut
    tl.storage.close()
