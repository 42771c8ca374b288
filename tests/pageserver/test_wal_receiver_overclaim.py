"""WAL receiver choice against a safekeeper that claims more than it sends.

The receiver streams from the safekeeper that answers the highest IDENTIFY_SYSTEM position. A
safekeeper whose answer is ahead of the WAL it actually sends (garbage, a stuck safekeeper whose
``commit_lsn`` is ahead of its local WAL) must not keep the receiver: once left for lagging it
must not be chosen again straight away, or an honest safekeeper's WAL is never received.
"""

from __future__ import annotations

import random

import trio
import trio.testing

from pageserver.wal_receiver import PgConnection, WalReceiver, WalReceiverConfig
from protocol.lsn import Lsn
from protocol.wal.encoder import WalEncoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import RmgrId
from tests.pageserver.test_wal_receiver import (
    START,
    FakeConn,
    FakeSafekeeper,
    expected_records,
    make_wal,
)

LAG_S = 3.0


class _LyingConn(FakeConn):
    """Answers IDENTIFY_SYSTEM with a huge position, then streams only up to its commit."""

    async def query(self, sql: str) -> list[tuple[str | None, ...]]:
        await trio.lowlevel.checkpoint()
        self.sk.identified += 1
        return [("1", "1", "FFFFFFFF/0", None)]


async def test_a_safekeeper_claiming_more_than_it_sends_does_not_starve_the_receiver(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wal, _spans = make_wal(40, 21)
    honest = FakeSafekeeper(wal, random.Random(1), keepalive_s=1.0)
    liar = FakeSafekeeper(wal, random.Random(2), keepalive_s=1.0, commit=START)

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        await trio.lowlevel.checkpoint()
        return FakeConn(honest) if port == 1 else _LyingConn(liar)

    got: list[tuple[Lsn, Lsn]] = []

    async def on_records(recs: list[DecodedRecord]) -> None:
        got.extend((r.lsn, r.end_lsn) for r in recs)
        await trio.lowlevel.checkpoint()

    cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2)))
    recv = WalReceiver(cfg, start_lsn=START, on_records=on_records, connect=connect)
    want = expected_records(wal, START)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        # One lagging_wal_timeout_s lost on the liar is the price of believing it once.
        with trio.fail_after(3 * LAG_S):
            await recv.wait_for_lsn(want[-1][1])
        nursery.cancel_scope.cancel()
    assert got == want
    assert recv.last_error is not None and "h:2" in recv.last_error


async def test_a_safekeeper_whose_wal_diverged_before_the_resume_point_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The receiver got WAL up to L from A (A's commit position then stays at L), and moves
    to B, which claims more. B's record at L does not name the record that ended at L as
    xl_prev: B's history before L is not the one ingested (a term it lost, another
    timeline). Its records must not be ingested on top of A's."""
    wal, spans = make_wal(40, 22)
    stop = spans[19]  # L = stop[1], the end of record 19
    enc = WalEncoder(stop[1], prev_lsn=stop[0] - 8)  # a different record before L
    for _ in range(10):
        enc.append(RmgrId.XLOG, 0x20, main_data=bytes(100))
    other = wal[: stop[1] - START] + bytes(enc.take())
    a = FakeSafekeeper(wal, random.Random(1), keepalive_s=1.0, commit=stop[1])
    b = FakeSafekeeper(other, random.Random(2), keepalive_s=1.0, refuse=True)

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        await trio.lowlevel.checkpoint()
        sk = a if port == 1 else b
        if sk.refuse:
            raise ConnectionRefusedError(port)
        return FakeConn(sk)

    got: list[tuple[Lsn, Lsn]] = []

    async def on_records(recs: list[DecodedRecord]) -> None:
        got.extend((r.lsn, r.end_lsn) for r in recs)
        await trio.lowlevel.checkpoint()

    cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2)))
    recv = WalReceiver(cfg, start_lsn=START, on_records=on_records, connect=connect)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        with trio.fail_after(10):
            await recv.wait_for_lsn(stop[1])
        b.refuse = False
        await trio.sleep(10 * LAG_S)
        nursery.cancel_scope.cancel()
    assert b.starts, "the receiver never tried the safekeeper that claims more"
    assert got == expected_records(wal, START)[:20], got[18:]
    assert recv.last_error is not None and "prev-link" in recv.last_error
