"""The WAL receiver against fake safekeepers serving synthetic WAL.

The fakes speak the replication sub-protocol (XLogData, keepalives; standby status updates
back) over the receiver's connection interface, cut streams at random points and refuse
connections, so the tests can check what matters: every record reaches ``on_record`` exactly
once and in order across reconnections, the receiver moves to another safekeeper, it reports
its progress, and it stops at once when cancelled.
"""

from __future__ import annotations

import random

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.wal_receiver import (
    PgConnection,
    Progress,
    WalIngestError,
    WalReceiver,
    WalReceiverConfig,
    parse_safekeepers,
)
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn, format_lsn
from protocol.replication import (
    PrimaryKeepalive,
    StandbyStatusUpdate,
    StartReplication,
    XLogData,
    decode_client_copy_data,
    encode_copy_message,
    parse_replication_command,
)
from protocol.wal.encoder import WalEncoder
from protocol.wal.reader import EndOfWal, NeedData, WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import RmgrId

START = Lsn(0x0100_0000 + 40)  # just after a segment's long page header


def make_wal(n_records: int, seed: int) -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    rng = random.Random(seed)
    enc = WalEncoder(START, prev_lsn=START - 100)
    spans = []
    for _ in range(n_records):
        size = rng.choice([0, 8, 100, 3000, 9000, 20000])
        spans.append(enc.append(RmgrId.XLOG, 0x20, main_data=rng.randbytes(size)))  # XLOG_NOOP
    return enc.take(), spans


@attrs.define
class FakeSafekeeper:
    """Serves ``wal`` (which starts at START) up to ``commit`` (all of it if None); cuts each
    stream after ``cut`` bytes if set. Caught up, it sends one keepalive and then nothing, or,
    with ``keepalive_s``, a keepalive every ``keepalive_s`` as a real safekeeper does."""

    wal: bytes
    rng: random.Random
    cut: int | None = None
    refuse: bool = False
    commit: Lsn | None = None
    keepalive_s: float | None = None
    identified: int = 0
    starts: list[Lsn] = attrs.field(factory=list)
    statuses: list[StandbyStatusUpdate] = attrs.field(factory=list)
    options: list[str] = attrs.field(factory=list)


class FakeConn:
    def __init__(self, sk: FakeSafekeeper) -> None:
        self.sk = sk
        self.pos = Lsn(0)
        self.sent = 0
        self.closed = False
        self.keepalive_sent = False

    @property
    def end(self) -> Lsn:
        end = Lsn(START + len(self.sk.wal))
        return end if self.sk.commit is None else min(end, self.sk.commit)

    async def query(self, sql: str) -> list[tuple[str | None, ...]]:
        await trio.lowlevel.checkpoint()
        assert sql == "IDENTIFY_SYSTEM"
        self.sk.identified += 1
        return [("1", "1", format_lsn(self.end), None)]

    async def copy_both(self, sql: str) -> FakeConn:
        await trio.lowlevel.checkpoint()
        cmd = parse_replication_command(sql)
        assert isinstance(cmd, StartReplication) and cmd.physical
        self.sk.starts.append(cmd.start_lsn)
        self.pos = cmd.start_lsn
        return self

    async def send(self, payload: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        msg = decode_client_copy_data(payload)
        assert isinstance(msg, StandbyStatusUpdate)
        self.sk.statuses.append(msg)

    async def receive(self) -> bytes | None:
        await trio.sleep(0.001)
        end = self.end
        if self.sk.cut is not None and self.sent >= self.sk.cut:
            raise EOFError("stream cut")
        if self.pos >= end:
            if self.keepalive_sent:
                if self.sk.keepalive_s is None:
                    await trio.sleep_forever()
                await trio.sleep(self.sk.keepalive_s)
            self.keepalive_sent = True
            return encode_copy_message(PrimaryKeepalive(Lsn(end), 0, True))
        n = self.sk.rng.choice([1, 7, 100, 8192, 131072])
        if self.sk.cut is not None:
            n = max(1, min(n, self.sk.cut - self.sent))
        off = self.pos - START
        data = self.sk.wal[off : min(off + n, end - START)]
        msg = XLogData(self.pos, Lsn(end), 0, data)
        self.pos = Lsn(self.pos + len(data))
        self.sent += len(data)
        return encode_copy_message(msg)

    async def aclose(self) -> None:
        self.closed = True


def connector(sks: dict[int, FakeSafekeeper]):  # type: ignore[no-untyped-def]
    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        await trio.lowlevel.checkpoint()
        sk = sks[port]
        if sk.refuse:
            raise ConnectionRefusedError(f"port {port}")
        sk.options.append(params.get("options", ""))
        return FakeConn(sk)

    return connect


def expected_records(wal: bytes, start: Lsn) -> list[tuple[Lsn, Lsn]]:
    dec = WalStreamDecoder(start)
    dec.feed(wal[start - START :])
    return [(r.lsn, r.end_lsn) for r in dec.records()]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([None, 30000, 70000, 200000]), st.integers(0, 5))
def test_every_record_once_in_order_across_cuts(seed: int, cut: int | None, skip: int) -> None:
    wal, spans = make_wal(40, seed)
    start = spans[skip][0]  # a record start, as last_record_lsn always is

    async def main() -> None:
        rng = random.Random(seed)
        sks = {p: FakeSafekeeper(wal, rng, cut=cut) for p in (1, 2, 3)}
        sks[2].refuse = True
        got: list[tuple[Lsn, Lsn]] = []

        async def on_record(rec: DecodedRecord) -> None:
            got.append((rec.lsn, rec.end_lsn))

        cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2), ("h", 3)))
        recv = WalReceiver(cfg, start_lsn=start, on_record=on_record, connect=connector(sks))
        want = expected_records(wal, start)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            with trio.fail_after(600):
                await recv.wait_for_lsn(want[-1][1])
            nursery.cancel_scope.cancel()
        assert got == want
        # Each session started where the previous one's last whole record ended.
        restarts = sorted(sks[1].starts + sks[3].starts)
        assert restarts[0] == start
        assert all(s in {start} | {end for _, end in want} for s in restarts)
        if cut is not None and cut < len(wal) - (start - START):
            assert len(restarts) > 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_reports_progress_and_uses_tenant_options(autojump_clock: trio.testing.MockClock) -> None:
    from protocol.ids import TenantId, TimelineId

    wal, spans = make_wal(10, 7)
    sk = FakeSafekeeper(wal, random.Random(1))
    tenant, timeline = TenantId.generate(), TimelineId.generate()
    cfg = WalReceiverConfig(
        safekeepers=(("h", 1),), tenant_id=tenant, timeline_id=timeline, status_interval_s=0.5
    )

    async def on_record(rec: DecodedRecord) -> None:
        await trio.lowlevel.checkpoint()

    recv = WalReceiver(
        cfg,
        start_lsn=START,
        on_record=on_record,
        connect=connector({1: sk}),
        progress=lambda: Progress(Lsn(START + 8), Lsn(START)),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        await recv.wait_for_lsn(spans[-1][1])
        # Wait for a status update that reports the last record (sent every 0.5 s and on the
        # keepalive's reply request), with a deadline generous enough for a loaded CI box.
        with trio.fail_after(30):
            while not sk.statuses or sk.statuses[-1].write_lsn < spans[-1][1]:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert sk.options == [f"-c timeline_id={timeline} tenant_id={tenant}"]
    assert sk.statuses, "no standby status update sent"
    last = sk.statuses[-1]
    assert (last.write_lsn, last.flush_lsn, last.apply_lsn) == (spans[-1][1], START + 8, START)


async def test_cancellation_is_prompt_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    # Virtual time: "prompt" measures what the receiver waits for, not how loaded the machine is.
    wal, _ = make_wal(3, 3)
    sk = FakeSafekeeper(wal, random.Random(2))
    conns: list[FakeConn] = []

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        c = FakeConn(sk)
        conns.append(c)
        return c

    async def on_record(rec: DecodedRecord) -> None:
        pass

    recv = WalReceiver(
        WalReceiverConfig(safekeepers=(("h", 1),)), start_lsn=START, on_record=on_record, connect=connect
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            # Cancel mid-session: once it has connected and received something.
            while recv.current is None or recv.records_received == 0:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
            cancelled_at = trio.current_time()
    # Prompt: the connection's shielded close has a 1 s deadline.
    assert trio.current_time() - cancelled_at < 2
    assert conns and all(c.closed for c in conns)


def test_parse_safekeepers() -> None:
    assert parse_safekeepers("a:1, b:2") == (("a", 1), ("b", 2))
    with pytest.raises(ValueError):
        parse_safekeepers("a")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([None, 30000, 200000]), st.integers(0, 3))
def test_batches_in_order_and_a_failed_batch_is_sent_again(
    seed: int, cut: int | None, failures: int
) -> None:
    """``on_records``: each list holds whole records in order; when the callee fails part-way
    through a list, the next session starts at that list's first record (the callee skips
    what it already has, as the ingest does), so in the end every record was applied once."""
    wal, spans = make_wal(60, seed)
    start = spans[0][0]

    async def main() -> None:
        rng = random.Random(seed)
        sks = {p: FakeSafekeeper(wal, rng, cut=cut) for p in (1, 2)}
        applied: list[tuple[Lsn, Lsn]] = []
        batches: list[int] = []
        failures_left = failures

        async def on_records(recs: list[DecodedRecord]) -> None:
            nonlocal failures_left
            assert recs
            batches.append(len(recs))
            for i, rec in enumerate(recs):
                if applied and rec.end_lsn <= applied[-1][1]:
                    continue  # already applied in a session that failed
                if failures_left and i == len(recs) // 2 and len(recs) > 1:
                    failures_left -= 1
                    raise ConnectionResetError("the ingest failed part-way")
                applied.append((rec.lsn, rec.end_lsn))
                await trio.lowlevel.checkpoint()

        cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2)))
        recv = WalReceiver(cfg, start_lsn=start, on_records=on_records, connect=connector(sks))
        want = expected_records(wal, start)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            with trio.fail_after(600):
                await recv.wait_for_lsn(want[-1][1])
            nursery.cancel_scope.cancel()
        assert applied == want
        assert recv.last_record_lsn == want[-1][1]
        assert max(batches) > 1  # records did arrive in lists

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_needs_exactly_one_callback() -> None:
    cfg = WalReceiverConfig(safekeepers=(("h", 1),))

    async def on_record(rec: DecodedRecord) -> None: ...

    async def on_records(recs: list[DecodedRecord]) -> None: ...

    with pytest.raises(ValueError, match="exactly one"):
        WalReceiver(cfg, start_lsn=START)
    with pytest.raises(ValueError, match="exactly one"):
        WalReceiver(cfg, start_lsn=START, on_record=on_record, on_records=on_records)


async def test_a_record_the_ingest_rejects_stops_the_receiver(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A record the ingest cannot parse (``RemoteProtocolError`` from the callee) is the same
    WAL from every safekeeper: retrying would spin forever (with ``ingest_failures`` never
    recorded), so the receiver stops with ``WalIngestError``. A connection error from the
    callee is still retried (``test_batches_in_order_and_a_failed_batch_is_sent_again``)."""
    wal, spans = make_wal(20, 7)
    start = spans[0][0]
    sks = {p: FakeSafekeeper(wal, random.Random(1)) for p in (1, 2)}
    calls = 0

    async def on_records(recs: list[DecodedRecord]) -> None:
        nonlocal calls
        calls += 1
        await trio.lowlevel.checkpoint()
        raise RemoteProtocolError(f"malformed heap record at {recs[0].lsn:X}", sqlstate="XX001")

    cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2)))
    recv = WalReceiver(cfg, start_lsn=start, on_records=on_records, connect=connector(sks))
    stopped: list[BaseException] = []
    with trio.fail_after(600):
        try:
            await recv.run()
        except* WalIngestError as eg:  # from inside the session's nursery
            stopped.extend(eg.exceptions)
    assert len(stopped) == 1 and "malformed heap record" in str(stopped[0])
    assert calls == 1
    assert recv.last_record_lsn == start


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([None, 30000, 70000]), st.integers(0, 3))
def test_on_wal_takes_every_record_once_in_order(seed: int, cut: int | None, failures: int) -> None:
    """``on_wal`` (the ingest's fused path) gets the fed decoder and says how many records it
    took and where the last one ended; sessions restart there, also after it failed
    part-way, and a record it rejects as malformed stops the receiver."""
    wal, spans = make_wal(60, seed)
    start = spans[0][0]

    async def main() -> None:
        rng = random.Random(seed)
        sks = {p: FakeSafekeeper(wal, rng, cut=cut) for p in (1, 2)}
        applied: list[tuple[Lsn, Lsn]] = []
        failures_left = failures

        async def on_wal(dec: WalStreamDecoder) -> tuple[int, Lsn, NeedData | EndOfWal]:
            nonlocal failures_left
            recs: list[DecodedRecord] = []
            stop = dec.decode_into(recs)
            for i, rec in enumerate(recs):
                if applied and rec.end_lsn <= applied[-1][1]:
                    continue  # already applied in a session that failed
                if failures_left and i == len(recs) // 2 and len(recs) > 1:
                    failures_left -= 1
                    raise ConnectionResetError("the ingest failed part-way")
                applied.append((rec.lsn, rec.end_lsn))
            await trio.lowlevel.checkpoint()
            return len(recs), recs[-1].end_lsn if recs else Lsn(0), stop

        cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2)))
        recv = WalReceiver(cfg, start_lsn=start, on_wal=on_wal, connect=connector(sks))
        want = expected_records(wal, start)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            with trio.fail_after(600):
                await recv.wait_for_lsn(want[-1][1])
            nursery.cancel_scope.cancel()
        assert applied == want
        assert recv.last_record_lsn == want[-1][1]
        assert recv.records_received >= len(want)

        async def rejecting(dec: WalStreamDecoder) -> tuple[int, Lsn, NeedData | EndOfWal]:
            raise RemoteProtocolError("bad record", sqlstate="XX001")

        recv = WalReceiver(cfg, start_lsn=start, on_wal=rejecting, connect=connector(sks))
        stopped: list[BaseException] = []
        try:
            await recv.run()
        except* WalIngestError as eg:  # from inside the session's nursery
            stopped.extend(eg.exceptions)
        assert len(stopped) == 1 and "bad record" in str(stopped[0])
        assert recv.last_record_lsn == start

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
