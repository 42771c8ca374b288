"""The bridge in-process: three real safekeeper nodes (no fsync) and a scripted PostgreSQL.

The scripted PostgreSQL (``ScriptedPostgres``) serves synthetic WAL over the replication
protocol the bridge speaks and can do what a real one does at awkward moments, on cue:

- crash with its flushed WAL ending at a page boundary inside a record, then come back as
  PostgreSQL 15's crash recovery does: the WAL before the boundary kept, an
  XLOG_OVERWRITE_CONTRECORD record on the next page (flag XLP_FIRST_IS_OVERWRITE_CONTRECORD);
- lose the bridge's physical slot (dropped by hand, or a data directory restored without it);
- misbehave: skip bytes in its stream (a WAL gap in its XLogData).
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
from structlog.testing import capture_logs

from common import pgclient
from compute.walproposer.bridge import (
    Bridge,
    BridgeConfig,
    PgConnection,
    PostgresInfo,
    SafekeeperAddr,
)
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.pgwire import sqlstate
from protocol.pgwire.errors import PgError
from protocol.replication import (
    CreateReplicationSlot,
    ReadReplicationSlot,
    StandbyStatusUpdate,
    StartReplication,
    XLogData,
    decode_client_copy_data,
    decode_server_copy_data,
    encode_copy_message,
    parse_replication_command,
    pg_now,
)
from protocol.wal.encoder import WalEncoder
from protocol.wal.page import XLP_FIRST_IS_OVERWRITE_CONTRECORD
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import XLOG_NOOP, XLOG_OVERWRITE_CONTRECORD, RmgrId
from safekeeper.config import SafekeeperConfig
from safekeeper.node import SafekeeperNode
from safekeeper.record_tracker import RecordTracker
from safekeeper.testing import TestProposer, synthetic_wal

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
SYSTEM_ID = 7
START = Lsn(WAL_SEGMENT_SIZE + 0x28)  # just after the first segment's long page header
PG_PORT = 1  # never dialled: the connector routes it to the scripted PostgreSQL


@attrs.define(eq=False)
class ScriptedPostgres:
    """PostgreSQL's side of the replication protocol over WAL bytes held in memory."""

    wal: bytes
    flush: Lsn
    slot_lsn: Lsn | None = START
    incarnation: int = 0
    changed: trio.Event = attrs.field(factory=trio.Event)
    # (incarnation, flush_lsn) of every standby status update the bridge sent.
    statuses: list[tuple[int, Lsn]] = attrs.field(factory=list)
    slot_advances: list[Lsn] = attrs.field(factory=list)
    slots_created: int = 0
    # WAL below this is gone (recycled): streams asked to start there fail as PostgreSQL's do.
    removed_before: Lsn = START
    # Seconds before each message of a replication stream (a real server is not in-process).
    latency: float = 0.0
    # A fault: every stream that reaches this LSN skips 8 bytes there (a gap in its XLogData).
    gap_at: Lsn | None = None

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def read(self, begin: Lsn, end: Lsn) -> bytes:
        return self.wal[begin - START : end - START]

    def crash_and_recover(self, end_of_log: Lsn, new_wal: bytes) -> None:
        """Every connection breaks; recovery ended at ``end_of_log`` and PostgreSQL wrote
        ``new_wal`` from there (all of it flushed)."""
        self.wal = self.wal[: end_of_log - START] + new_wal
        self.flush = Lsn(START + len(self.wal))
        self.incarnation += 1
        self._notify()

    def break_connections(self) -> None:
        """Every connection fails (a restart, a network hiccup); the WAL stays as it was."""
        self.incarnation += 1
        self._notify()

    def drop_slot(self) -> None:
        self.slot_lsn = None

    def connect(self) -> ScriptedConnection:
        return ScriptedConnection(self, self.incarnation)


@attrs.define(eq=False)
class ScriptedConnection:
    pg: ScriptedPostgres
    incarnation: int

    def _check_alive(self) -> None:
        if self.pg.incarnation != self.incarnation:
            raise trio.BrokenResourceError("server closed the connection unexpectedly")

    async def query(self, sql: str) -> list[tuple[str | None, ...]]:
        self._check_alive()
        pg = self.pg
        if sql == "IDENTIFY_SYSTEM":
            return [(str(SYSTEM_ID), "1", format_lsn(pg.flush), None)]
        if sql == "SHOW server_version_num":
            return [("150000",)]
        if sql == "SHOW wal_segment_size":
            return [("16MB",)]
        if sql == ReadReplicationSlot("walproposer").to_sql():
            if pg.slot_lsn is None:
                return [(None, None, None)]
            return [("physical", format_lsn(pg.slot_lsn), "1")]
        if sql == CreateReplicationSlot("walproposer", reserve_wal=True).to_sql():
            # RESERVE_WAL: the last checkpoint's redo point; here, what is flushed now.
            pg.slot_lsn = pg.flush
            pg.slots_created += 1
            return []
        m = re.fullmatch(r"select pg_replication_slot_advance\('walproposer', '(\S+)'\)", sql)
        if m:
            if pg.slot_lsn is None:
                raise PgError(
                    'replication slot "walproposer" does not exist', sqlstate.UNDEFINED_OBJECT
                )
            target = Lsn(int(m[1].split("/")[0], 16) << 32 | int(m[1].split("/")[1], 16))
            pg.slot_lsn = Lsn(max(pg.slot_lsn, target))
            pg.slot_advances.append(target)
            return [("walproposer", m[1])]
        raise AssertionError(f"unexpected query {sql!r}")

    async def copy_both(self, sql: str) -> ScriptedStream:
        self._check_alive()
        cmd = parse_replication_command(sql)
        assert isinstance(cmd, StartReplication) and cmd.slot is None, sql
        if cmd.start_lsn < self.pg.removed_before:
            raise PgError(
                f"requested WAL segment for {format_lsn(cmd.start_lsn)} has already been removed"
            )
        if cmd.start_lsn > self.pg.flush:
            raise PgError(
                f"requested starting point {format_lsn(cmd.start_lsn)} is ahead of the WAL "
                f"flush position of this server {format_lsn(self.pg.flush)}"
            )
        return ScriptedStream(self, cmd.start_lsn)

    async def aclose(self) -> None:
        pass


@attrs.define(eq=False)
class ScriptedStream:
    conn: ScriptedConnection
    pos: Lsn

    async def receive(self) -> bytes | None:
        pg = self.conn.pg
        await trio.sleep(pg.latency)
        while True:
            self.conn._check_alive()
            if self.pos < pg.flush:
                if self.pos == pg.gap_at:
                    self.pos = Lsn(self.pos + 8)
                end = Lsn(min(pg.flush, self.pos + 20_000))
                if pg.gap_at is not None and self.pos < pg.gap_at:
                    end = Lsn(min(end, pg.gap_at))
                msg = XLogData(self.pos, pg.flush, pg_now(), pg.read(self.pos, end))
                self.pos = end
                return encode_copy_message(msg)
            await pg.changed.wait()

    async def send(self, payload: bytes | bytearray | memoryview) -> None:
        self.conn._check_alive()
        msg = decode_client_copy_data(payload)
        if isinstance(msg, StandbyStatusUpdate):
            self.conn.pg.statuses.append((self.conn.incarnation, msg.flush_lsn))


def record_ends(wal: bytes) -> list[Lsn]:
    """End LSN of every complete record in ``wal`` (which starts at ``START``)."""
    tracker = RecordTracker(START)
    ends: list[Lsn] = []
    for i in range(0, len(wal), 512):
        end = tracker.feed(wal[i : i + 512])
        if not ends or end != ends[-1]:
            ends.append(end)
    return ends


@attrs.define
class Links:
    """The bridge's connections as the test sees them: every attempt (by port, and for
    PostgreSQL by application_name), ports that refuse, the last connection to each safekeeper."""

    attempts: dict[int | str, list[float]] = attrs.field(factory=dict)
    refused: set[int] = attrs.field(factory=set)
    # PostgreSQL application_names whose connection attempt raises a bug-like RuntimeError.
    buggy: set[str] = attrs.field(factory=set)
    conns: dict[int, pgclient.PgClientConnection] = attrs.field(factory=dict)

    def count(self, key: int | str) -> int:
        return len(self.attempts.get(key, []))


@attrs.define
class Setup:
    pg: ScriptedPostgres
    nodes: list[SafekeeperNode]
    bridge: Bridge
    links: Links


def safekeeper_nodes(tmp_path: Path) -> list[SafekeeperNode]:
    return [
        SafekeeperNode(
            SafekeeperConfig(
                data_dir=str(tmp_path / f"sk{i}"),
                id=i + 1,
                listen_pg="127.0.0.1:0",
                listen_http="127.0.0.1:0",
                no_sync=True,
            )
        )
        for i in range(3)
    ]


@pytest.fixture
async def setup(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    # ``indirect`` parametrization may set the bridge's window size.
    buffer_bytes: int = getattr(request, "param", {}).get("buffer_bytes", 64 * 1024 * 1024)
    wal = synthetic_wal(START, 400_000, record_size=3000, system_id=SYSTEM_ID)
    pg = ScriptedPostgres(wal=wal, flush=START)
    nodes = safekeeper_nodes(tmp_path)

    links = Links()

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        key: int | str = params.get("application_name", "") if port == PG_PORT else port
        links.attempts.setdefault(key, []).append(trio.current_time())
        if port in links.refused:
            raise ConnectionRefusedError(f"{host}:{port} refused (test)")
        if key in links.buggy:
            raise RuntimeError(f"injected bug connecting {key}")
        if port == PG_PORT:
            return pg.connect()
        conn = await pgclient.connect_with_params(host, port, params)
        links.conns[port] = conn
        return conn

    async with trio.open_nursery() as nursery:
        for node in nodes:
            await nursery.start(node.run)
        cfg = BridgeConfig(
            pg_host="127.0.0.1",
            pg_port=PG_PORT,
            safekeepers=tuple(SafekeeperAddr("127.0.0.1", n.pg_port or 0) for n in nodes),
            tenant_id=TENANT,
            timeline_id=TIMELINE,
            start_lsn=START,
            slot_interval_s=0.05,
            buffer_bytes=buffer_bytes,
        )
        bridge = Bridge(cfg, connect)
        await nursery.start(bridge.run)
        yield Setup(pg, nodes, bridge, links)
        nursery.cancel_scope.cancel()
        for node in nodes:
            node.stop()


async def safekeeper_wal(node: SafekeeperNode, end: Lsn) -> bytes:
    """What the safekeeper streams out from ``START`` up to ``end``."""
    conn = await pgclient.connect(
        "127.0.0.1", node.pg_port or 0, user="postgres", params={"replication": "true"},
        options={"tenant_id": TENANT.hex, "timeline_id": TIMELINE.hex},
    )
    async with conn:
        copy = await conn.copy_both(StartReplication(START).to_sql())
        out = bytearray()
        while START + len(out) < end:
            payload = await copy.receive()
            assert payload is not None
            msg = decode_server_copy_data(payload)
            if isinstance(msg, XLogData):
                out += msg.data
    return bytes(out[: end - START])


async def wait_commit(bridge: Bridge, lsn: Lsn) -> None:
    while bridge.proposer.commit_lsn < lsn:
        await trio.sleep(0.02)


def wal_with_record_starts(size: int, record_size: int) -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    """Valid WAL from ``START`` and the (start, end) of each record in it."""
    enc = WalEncoder(START, system_identifier=SYSTEM_ID)
    body = bytes(range(256)) * (record_size // 256 + 1)
    records: list[tuple[Lsn, Lsn]] = []
    while enc.buffered < size:
        enc.append(RmgrId.XLOG, XLOG_NOOP, main_data=body[: record_size - 26])
        records.append((enc.prev_lsn, enc.insert_lsn))
    return enc.take(), records


def overwrite_contrecord_wal(page: Lsn, aborted: Lsn, prev: Lsn) -> bytes:
    """What PostgreSQL 15 writes at ``page`` after crash recovery found the record at
    ``aborted`` incomplete there (``CreateOverwriteContrecordRecord``): the page flagged
    XLP_FIRST_IS_OVERWRITE_CONTRECORD, an XLOG_OVERWRITE_CONTRECORD record naming the aborted
    record (its xl_prev: the last complete record), then new records."""
    enc = WalEncoder(page, prev_lsn=prev, system_identifier=SYSTEM_ID)
    enc.append(RmgrId.XLOG, XLOG_OVERWRITE_CONTRECORD, main_data=struct.pack("<Qq", aborted, 0))
    while enc.buffered < 100_000:
        enc.append(RmgrId.XLOG, XLOG_NOOP, main_data=bytes(974))
    wal = bytearray(enc.take())
    (info,) = struct.unpack_from("<H", wal, 2)  # xlp_info of the page header at ``page``
    struct.pack_into("<H", wal, 2, info | XLP_FIRST_IS_OVERWRITE_CONTRECORD)
    return bytes(wal)


async def test_postgres_crash_inside_a_record(setup: Setup) -> None:
    """PostgreSQL flushed (and streamed) WAL up to a page boundary inside a record, crashed,
    and came back: recovery keeps the WAL before the boundary and writes an
    OVERWRITE_CONTRECORD record on the page. The bridge resumes its stream at the boundary (in
    the same term: nothing it sent changed); the safekeepers must end up with PostgreSQL's WAL
    byte for byte, and commits go on."""
    pg, bridge = setup.pg, setup.bridge
    pg.wal, records = wal_with_record_starts(400_000, 3000)
    cut = Lsn(START - START % 8192 + 20 * 8192)
    k = next(k for k, (b, e) in enumerate(records) if b < cut < e)
    aborted, prev = records[k][0], records[k - 1][0]
    with trio.fail_after(30):
        pg.flush = cut
        pg._notify()
        await wait_commit(bridge, records[k - 1][1])
        for slot in bridge.proposer.slots:
            while slot.streaming_at != cut:
                await trio.sleep(0.02)
    with trio.fail_after(5):  # well under 1 s once the safekeepers accept the page
        pg.crash_and_recover(cut, overwrite_contrecord_wal(cut, aborted, prev))
        new_end = Lsn(pg.flush - pg.flush % 8)
        # The pageserver's decoder reads this WAL (the records go on after the aborted one).
        assert record_ends_decoded(pg.wal)[-1] == new_end
        await wait_commit(bridge, new_end)
        expected = pg.read(START, new_end)
        for node in setup.nodes:
            assert await safekeeper_wal(node, new_end) == expected
        while (pg.incarnation, new_end) not in pg.statuses:
            await trio.sleep(0.02)


def record_ends_decoded(wal: bytes) -> list[Lsn]:
    """End LSNs of the records the pageserver's WAL decoder reads from ``wal``."""
    dec = WalStreamDecoder(START)
    dec.feed(wal)
    out: list[DecodedRecord] = []
    dec.decode_into(out)
    return [r.end_lsn for r in out]


async def test_lost_slot_is_created_again(setup: Setup) -> None:
    """Someone dropped the bridge's slot: without it PostgreSQL keeps no WAL for a lagging
    safekeeper. The bridge creates it again and keeps advancing it."""
    pg, bridge = setup.pg, setup.bridge
    ends = record_ends(pg.wal)
    with trio.fail_after(30):
        pg.flush = ends[30]
        pg._notify()
        await wait_commit(bridge, ends[30])
        while pg.slot_lsn != ends[30]:
            await trio.sleep(0.02)
        pg.drop_slot()
        pg.flush = ends[60]
        pg._notify()
        await wait_commit(bridge, ends[60])
        while not pg.slots_created:
            await trio.sleep(0.02)
        # Created at PostgreSQL's redo point, then advanced with the safekeepers again.
        pg.flush = ends[90]
        pg._notify()
        while pg.slot_lsn != ends[90]:
            await trio.sleep(0.02)
        assert bridge.slot_lsn == ends[90]


async def test_reconnects_are_quick_again_after_a_long_outage(setup: Setup) -> None:
    """A safekeeper (and PostgreSQL) unreachable for a while: retries back off to
    ``max_backoff_s``. Once a connection worked again, the next failure is a new one and is
    retried at once; an old outage must not delay every later reconnect by 2 s (with another
    safekeeper down, commits would wait that long)."""
    pg, bridge, links = setup.pg, setup.bridge, setup.links
    ends = record_ends(pg.wal)
    port = setup.nodes[0].pg_port or 0
    stream = "walproposer"  # the application_name of the bridge's replication stream
    with trio.fail_after(40):
        pg.flush = ends[10]
        pg._notify()
        await wait_commit(bridge, ends[10])

        # Both away for > 3 s: 0.05 + 0.1 + ... + 1.6 s of back-off reaches the 2 s cap.
        n_sk, n_pg = links.count(port), links.count(stream)
        links.refused |= {port, PG_PORT}
        await links.conns[port].aclose()
        pg.break_connections()
        while links.count(port) < n_sk + 7 or links.count(stream) < n_pg + 7:
            await trio.sleep(0.05)
        links.refused -= {port, PG_PORT}
        pg.flush = ends[20]
        pg._notify()
        while bridge.proposer.slots[0].acked_flush_lsn < ends[20]:
            await trio.sleep(0.02)

        # A new, brief failure of each: the next attempt comes at once.
        n_sk, n_pg = links.count(port), links.count(stream)
        broken_at = trio.current_time()
        await links.conns[port].aclose()
        pg.break_connections()
        while links.count(port) == n_sk or links.count(stream) == n_pg:
            await trio.sleep(0.01)
        assert links.attempts[port][n_sk] - broken_at < 0.5
        assert links.attempts[stream][n_pg] - broken_at < 0.5


@pytest.mark.parametrize("setup", [{"buffer_bytes": 16 * 1024}], indirect=True)
async def test_safekeeper_that_cannot_catch_up_keeps_backing_off(setup: Setup) -> None:
    """A safekeeper came back needing WAL that is older than the window and that PostgreSQL no
    longer has: each session is elected, then its catch-up fails at once. That is the same
    outage going on, not a new failure: the retries keep backing off instead of reconnecting
    (an election and a PostgreSQL connection each time) every 50 ms."""
    pg, bridge, links = setup.pg, setup.bridge, setup.links
    ends = record_ends(pg.wal)
    port = setup.nodes[0].pg_port or 0
    with trio.fail_after(30):
        pg.flush = ends[10]
        pg._notify()
        await wait_commit(bridge, ends[10])
        n = links.count(port)
        links.refused.add(port)
        await links.conns[port].aclose()
        while links.count(port) < n + 2:
            await trio.sleep(0.01)
        pg.flush = ends[60]
        pg._notify()
        await wait_commit(bridge, ends[60])
        assert bridge.buffer.start > ends[10]  # sk0 must catch up from PostgreSQL...
        pg.removed_before = ends[50]  # ...which recycled that WAL
        links.refused.discard(port)
        n = links.count(port)
        await trio.sleep(3.0)
        # 0.4 + 0.8 + 1.6 s of back-off fit in 3 s, plus the sessions themselves.
        assert links.count(port) - n <= 6, links.count(port) - n
        assert bridge.proposer.commit_lsn == ends[60]  # the quorum went on


def spacing(times: list[float]) -> list[float]:
    return [round(b - a, 3) for a, b in itertools.pairwise(times)]


async def test_wal_gap_from_postgres_backs_off_in_the_same_term(setup: Setup) -> None:
    """PostgreSQL's stream skips bytes: that is PostgreSQL's fault (RemoteProtocolError naming
    the gap), it ends the stream, not the term, and as long as the fault persists the stream is
    retried with growing delays (not restarted every 0.2 s with a new election each time).
    Once the fault goes away the stream resumes where the window ends and commits go on."""
    pg, bridge, links = setup.pg, setup.bridge, setup.links
    ends = record_ends(pg.wal)
    stream = "walproposer"
    gap_at = Lsn(ends[20] + 100)
    with trio.fail_after(30), capture_logs() as logs:
        pg.flush = ends[10]
        pg._notify()
        await wait_commit(bridge, ends[10])
        n = links.count(stream)
        pg.gap_at = gap_at
        pg.flush = ends[40]
        pg._notify()
        await wait_commit(bridge, ends[20])  # the WAL before the gap is committed
        while links.count(stream) < n + 2:
            await trio.sleep(0.01)
        first_retry = links.attempts[stream][n + 1]
        await trio.sleep(2.0)
        retries = [t for t in links.attempts[stream][n + 1 :] if t - first_retry <= 2.0]
        # 0.1 + 0.2 + 0.4 + 0.8 s of back-off: five attempts in 2 s.
        assert len(retries) <= 6, spacing(retries)
        gaps = spacing(retries)
        assert gaps[-1] >= 0.35 and gaps[-1] - gaps[0] >= 0.25, gaps
        assert bridge.terms_run == 1
        err = bridge.last_postgres_error
        assert isinstance(err, RemoteProtocolError), repr(err)
        assert f"where its stream is at {format_lsn(gap_at)} (a gap" in str(err)
        assert bridge.proposer.commit_lsn == ends[20]
        # The cause, once per attempt, with where the stream stood and when it retries.
        lost = [e for e in logs if e["event"] == "postgres replication stream lost"]
        assert len(lost) - (links.count(stream) - n) in (0, 1)  # (the last may still wait)
        assert all("a gap in its XLogData" in e["error"] for e in lost)
        assert lost[-1]["window_end"] == format_lsn(gap_at)
        delays = [e["retry_in_s"] for e in lost]
        assert delays == sorted(delays) and delays[-1] >= 0.8, delays

        pg.gap_at = None
        await wait_commit(bridge, ends[40])
        assert bridge.terms_run == 1
        assert await safekeeper_wal(setup.nodes[0], ends[40]) == pg.read(START, ends[40])


async def test_failing_terms_back_off(setup: Setup) -> None:
    """A bug that ends every term (here: connecting the replication stream raises) starts
    terms over with growing delays, not an election every 0.2 s forever. After it goes away
    commits resume; a later failure of a term that committed is retried at once."""
    pg, bridge, links = setup.pg, setup.bridge, setup.links
    ends = record_ends(pg.wal)
    stream = "walproposer"
    with trio.fail_after(30), capture_logs() as logs:
        pg.flush = ends[10]
        pg._notify()
        await wait_commit(bridge, ends[10])
        n = links.count(stream)
        links.buggy.add(stream)
        pg.break_connections()
        while links.count(stream) < n + 2:
            await trio.sleep(0.01)
        first_retry = links.attempts[stream][n + 1]  # the first failing term's
        await trio.sleep(2.0)
        # Each failing term is an election first: ~10 ms on a quiet machine, up to ~0.5 s
        # beside the rest of a parallel test run, which hides the first doublings of the
        # delay in the gaps. So the gaps are read once a term has waited 0.8 s or more, at
        # least 2 s after the first retry (the election-storm bound is over those 2 s).
        while not any(
            e["event"] == "term failed, starting over" and e["retry_in_s"] >= 0.8 for e in logs
        ):
            await trio.sleep(0.01)
        m = links.count(stream)
        while links.count(stream) == m:  # the attempt after that wait (or a later one)
            await trio.sleep(0.01)
        attempts = [t for t in links.attempts[stream][n + 1 :] if t - first_retry <= 2.0]
        assert len(attempts) <= 6, spacing(attempts)
        gaps = spacing(links.attempts[stream][n + 1 :])
        assert gaps[-1] >= 0.35 and gaps[-1] - gaps[0] >= 0.25, gaps
        assert isinstance(bridge.last_term_error, RuntimeError)
        assert "injected bug" in str(bridge.last_term_error)
        failed = [e for e in logs if e["event"] == "term failed, starting over"]
        assert [e["term"] for e in failed] == list(range(1, len(failed) + 1))
        assert len(failed) in (bridge.terms_run - 1, bridge.terms_run)
        assert all(e["exc_info"] for e in failed)
        delays = [e["retry_in_s"] for e in failed]
        assert delays == sorted(delays) and delays[-1] >= 0.8, delays

        links.buggy.clear()
        pg.flush = ends[20]
        pg._notify()
        await wait_commit(bridge, ends[20])

        # That term committed: its failure is a new one, the next term starts at once.
        n = links.count(stream)
        links.buggy.add(stream)
        pg.break_connections()
        while links.count(stream) == n:
            await trio.sleep(0.01)
        links.buggy.clear()
        while links.count(stream) < n + 2:
            await trio.sleep(0.01)
        assert links.attempts[stream][n + 1] - links.attempts[stream][n] < 0.5
        pg.flush = ends[30]
        pg._notify()
        await wait_commit(bridge, ends[30])


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[list[SafekeeperNode]]:
    """Three safekeeper nodes and no bridge."""
    nodes = safekeeper_nodes(tmp_path)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            await nursery.start(node.run)
        yield nodes
        for node in nodes:
            node.stop()


def sk_status(node: SafekeeperNode) -> dict[str, object]:
    tl = node.find_timeline(TENANT.hex, TIMELINE.hex)
    assert tl is not None
    return tl.status()


async def dead_compute_left(
    nodes: list[SafekeeperNode], minority_tail: bool = False
) -> tuple[bytes, Lsn, Lsn]:
    """What a compute that died leaves: one term's WAL flushed up to ``tail`` on sk0 and sk1
    and up to ``mid`` on sk2, committed (on the safekeepers) only up to an earlier point."""
    wal = synthetic_wal(START, 100_000, record_size=300, system_id=SYSTEM_ID)
    ends = record_ends(wal)
    tail, mid, committed_before = ends[-1], ends[len(ends) * 2 // 3], ends[len(ends) // 3]
    positions = (tail, mid, mid) if minority_tail else (tail, tail, mid)
    for node, end in zip(nodes, positions, strict=True):
        async with await TestProposer.connect("127.0.0.1", node.pg_port or 0, TENANT, TIMELINE) as tp:
            await tp.greet(system_id=SYSTEM_ID)
            assert await tp.elect(START, term=1) == START
            data = wal[: end - START]
            chunks = [data[i : i + 8192] for i in range(0, len(data), 8192)]
            await tp.append_many(START, chunks, commit=False)
            await tp.append(end, b"", commit_lsn=committed_before)
            await tp.wait_flush(end)
    for node, end in zip(nodes, positions, strict=True):
        st = sk_status(node)
        assert (st["flush_lsn"], st["commit_lsn"]) == (format_lsn(end), format_lsn(committed_before))

    return wal, tail, mid


async def test_sync_safekeepers_commits_what_a_dead_compute_left(nodes: list[SafekeeperNode]) -> None:
    """A compute died right after its last WAL was flushed on the safekeepers, before the
    commit position that covers it was sent: they hold WAL they will never stream to a
    pageserver (only committed WAL goes there). sync-safekeepers wins a new term with no
    PostgreSQL and commits it, so a new compute can start where that WAL ends.

    sk0 and sk1 hold all of it, sk2 only part; sk1 answers late, so the vote is sk0's and
    sk2's: the donor (sk0) starts streaming above the end of the (empty) window, which starts
    at sk2's position. That voter gets heartbeats and commit_lsn, no WAL, until WAL arrives."""
    wal, tail, mid = await dead_compute_left(nodes)

    late = nodes[1].pg_port

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        if port == late:
            await trio.sleep(0.5)
        return await pgclient.connect_with_params(host, port, params)

    cfg = BridgeConfig(
        pg_host="127.0.0.1", pg_port=PG_PORT,
        safekeepers=tuple(SafekeeperAddr("127.0.0.1", n.pg_port or 0) for n in nodes),
        tenant_id=TENANT, timeline_id=TIMELINE,
    )
    bridge = Bridge(cfg, connect)
    with trio.fail_after(20):
        end = await bridge.sync_safekeepers(
            PostgresInfo(SYSTEM_ID, 150000, WAL_SEGMENT_SIZE, INVALID_LSN)
        )
    assert end == tail
    assert bridge.proposer.term == 2 and bridge.terms_run == 1
    assert bridge.buffer.start == mid  # the vote was sk0's and sk2's, as arranged
    committed = [sk_status(n)["commit_lsn"] == format_lsn(tail) for n in nodes]
    assert sum(committed) >= 2, committed
    # What a pageserver is sent now reaches the end of that WAL.
    assert await safekeeper_wal(nodes[0], tail) == wal[: tail - START]


async def test_restarted_bridge_with_voters_at_different_positions(
    nodes: list[SafekeeperNode],
) -> None:
    """The bridge restarts while the safekeepers stand at different positions (one lagged),
    and the vote is the donor's and a lagging one's. The window starts at the lagging voter's
    position, so the donor starts streaming above its end: it must get heartbeats until the
    window reaches it, not fail the term (which fails again in every new term: commits would
    never resume)."""
    with trio.fail_after(20):
        wal, tail, _ = await dead_compute_left(nodes)
    pg = ScriptedPostgres(wal=wal, flush=tail, latency=0.05)
    late = nodes[1].pg_port

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        if port == PG_PORT:
            return pg.connect()
        if port == late:
            await trio.sleep(0.5)
        return await pgclient.connect_with_params(host, port, params)

    cfg = BridgeConfig(
        pg_host="127.0.0.1", pg_port=PG_PORT,
        safekeepers=tuple(SafekeeperAddr("127.0.0.1", n.pg_port or 0) for n in nodes),
        tenant_id=TENANT, timeline_id=TIMELINE,
    )
    bridge = Bridge(cfg, connect)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(20):
            await nursery.start(bridge.run)
            await wait_commit(bridge, tail)
            assert bridge.terms_run == 1
            # and the lagging safekeeper catches up from the window
            while bridge.proposer.slots[2].acked_flush_lsn < tail:
                await trio.sleep(0.02)
            # (the bridge still runs: commit_lsn reaches sk2 too, so it streams up to tail)
            for node in nodes:
                assert await safekeeper_wal(node, tail) == wal[: tail - START]
        nursery.cancel_scope.cancel()


async def test_sync_safekeepers_brings_a_minority_tail_to_a_quorum(
    nodes: list[SafekeeperNode],
) -> None:
    """Only sk0 holds the dead compute's last WAL; sk2 answers late, so the vote is sk0's and
    sk1's and sk0 is the donor. sk1 needs WAL no PostgreSQL can give: it gets it from the
    donor safekeeper, and the tail is committed on a quorum."""
    with trio.fail_after(20):
        wal, tail, mid = await dead_compute_left(nodes, minority_tail=True)
    late = nodes[2].pg_port

    async def connect(host: str, port: int, params: dict[str, str]) -> PgConnection:
        if port == late:
            await trio.sleep(0.5)
        return await pgclient.connect_with_params(host, port, params)

    cfg = BridgeConfig(
        pg_host="127.0.0.1", pg_port=PG_PORT,
        safekeepers=tuple(SafekeeperAddr("127.0.0.1", n.pg_port or 0) for n in nodes),
        tenant_id=TENANT, timeline_id=TIMELINE,
    )
    bridge = Bridge(cfg, connect)
    with trio.fail_after(20):
        end = await bridge.sync_safekeepers(
            PostgresInfo(SYSTEM_ID, 150000, WAL_SEGMENT_SIZE, INVALID_LSN)
        )
        assert end == tail and bridge.buffer.start == mid
        # The quorum is sk0 and sk1, which had to get the tail from sk0.
        for node in nodes[:2]:
            assert sk_status(node)["commit_lsn"] == format_lsn(tail)
            assert await safekeeper_wal(node, tail) == wal[: tail - START]
