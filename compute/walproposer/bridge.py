"""The walproposer bridge: the process beside a vanilla PostgreSQL 15 that makes N safekeepers
its durable WAL store.

Data path::

    PostgreSQL ──START_REPLICATION SLOT s PHYSICAL──► WalBuffer ──AppendRequest──► safekeeper × N
        ▲                                                                               │
        └──── standby status update: write = flush = apply = quorum flush LSN ◄─AppendResponse

PostgreSQL names the bridge in ``synchronous_standby_names`` (the bridge connects with that
``application_name``), so a commit returns to its client only once the bridge reports a flush
position past it, and the bridge reports only the LSN a quorum of safekeepers has fsynced
(``Proposer.commit_lsn``). The physical slot keeps PostgreSQL's WAL from that position on.

Tasks (one trio nursery per term; any task's failure ends the term):

- one per safekeeper: connect, ``START_WAL_PUSH (proto_version '3')``, greeting; then a reader
  (acceptor messages -> ``Proposer``) and a sender (vote/elected messages the proposer queued for
  it, then AppendRequests from its position, an empty one as heartbeat or to carry a new
  commit_lsn). A lost connection is retried with backoff; the rest keep going.
- one for PostgreSQL, started once we are elected: streams into the ``WalBuffer`` from the lowest
  position the voters need, answers keepalives and sends status updates when commit_lsn moves.
- a safekeeper whose position is older than the window catches up on a replication stream of
  its own from PostgreSQL (no slot), then returns to the shared window.

``ProposerRejected`` (a safekeeper in a higher term) ends the term: the bridge starts over with a
term above the one it saw, which is also what happens after the bridge itself restarts.

A lost PostgreSQL stream resumes in the same term at the end of the window, also after
PostgreSQL crashed and restarted: PostgreSQL never rewrites WAL it reported flushed. Its flush
position is a record end or a page boundary; when crash recovery finds the record across that
page boundary incomplete, PostgreSQL 15 keeps the part before the boundary and writes an
XLOG_OVERWRITE_CONTRECORD record on the next page (page flag XLP_FIRST_IS_OVERWRITE_CONTRECORD),
exactly so that a standby that already streamed the partial record stays consistent.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Final, Protocol

import attrs
import structlog
import trio

from common import pgclient
from compute.walproposer.proposer import Phase, Proposer, ProposerRejected, quorum_size
from compute.walproposer.walbuffer import WalBuffer
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn, format_lsn, parse_lsn
from protocol.pgwire import sqlstate
from protocol.pgwire.errors import PgError
from protocol.replication import (
    CreateReplicationSlot,
    IdentifySystem,
    PrimaryKeepalive,
    ReadReplicationSlot,
    StandbyStatusUpdate,
    StartReplication,
    StartWalPush,
    XLogData,
    decode_server_copy_data,
    encode_copy_message,
    pg_now,
)
from protocol.safekeeper import (
    MAX_SEND_SIZE,
    AcceptorGreeting,
    AppendRequest,
    AppendResponse,
    PageserverFeedback,
    ProposerElected,
    ProposerGreeting,
    VoteRequest,
    VoteResponse,
    decode_acceptor_message,
    encode_append_request_header,
    encode_message,
)

log = structlog.get_logger("walproposer")

PROTO_VERSION: Final = 3
# Reconnect delays double from this up to ``BridgeConfig.max_backoff_s`` while a peer stays
# unreachable, and start over from it once a connection worked.
MIN_BACKOFF_S: Final = 0.05
# ---------------------------------------------------------------------------------------------
# What the bridge needs from a libpq client (``common.pgclient`` provides it; tests may fake it)


class CopyStream(Protocol):
    async def receive(self) -> bytes | None:
        """The next CopyData payload; None when the peer ended the stream."""
        ...

    async def send(self, payload: bytes | bytearray | memoryview) -> None: ...


class PgConnection(Protocol):
    async def query(self, sql: str) -> list[tuple[str | None, ...]]: ...

    async def copy_both(self, sql: str) -> CopyStream: ...

    async def aclose(self) -> None: ...


# (host, port, startup parameters: user, dbname, options, replication, application_name)
Connector = Callable[[str, int, dict[str, str]], Awaitable[PgConnection]]


# The production connector.
pgclient_connect: Connector = pgclient.connect_with_params


async def receive_payload(copy: CopyStream) -> bytes:
    payload = await copy.receive()
    if payload is None:
        raise EOFError("the peer ended the COPY stream")
    return payload


# What ends one connection without ending the bridge.
CONNECTION_ERRORS = pgclient.CONNECTION_ERRORS


# ---------------------------------------------------------------------------------------------
# Configuration


@attrs.frozen
class SafekeeperAddr:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> SafekeeperAddr:
        """``host:port``."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"safekeeper address {text!r} is not host:port")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@attrs.frozen
class BridgeConfig:
    pg_host: str
    pg_port: int
    safekeepers: tuple[SafekeeperAddr, ...]
    tenant_id: TenantId
    timeline_id: TimelineId
    pg_user: str = "postgres"
    # The name PostgreSQL's synchronous_standby_names lists.
    application_name: str = "walproposer"
    slot_name: str = attrs.field(default="walproposer")
    # Where WAL starts on a fresh timeline; None: the slot's restart_lsn (see docs/walproposer.md).
    start_lsn: Lsn | None = None
    buffer_bytes: int = 64 * 1024 * 1024
    # The slot keeps WAL from the lowest safekeeper flush, but never more than this behind the
    # quorum (a safekeeper gone for good must not fill PostgreSQL's disk).
    max_slot_lag_bytes: int = 1024 * 1024 * 1024
    slot_interval_s: float = 1.0
    heartbeat_s: float = 1.0
    status_interval_s: float = 10.0
    connect_timeout_s: float = 5.0
    max_backoff_s: float = 2.0
    # The tenant token for safekeepers with auth on (from $PAGESTORE_AUTH_TOKEN, never argv);
    # repr=False: configs get logged, tokens never.
    auth_token: str | None = attrs.field(default=None, repr=False)
    # A CA file: the safekeeper connections use TLS and verify the certificates against it.
    ssl_ca_file: str | None = None

    @slot_name.validator
    def _check_slot_name(self, _a: attrs.Attribute[str], value: str) -> None:
        # PostgreSQL's own rule; it also keeps the name safe to put into SQL text.
        if not re.fullmatch(r"[a-z0-9_]{1,63}", value):
            raise ValueError(f"slot name {value!r}: use 1-63 of a-z, 0-9 and _")


@attrs.frozen
class PostgresInfo:
    system_id: int
    pg_version: int
    wal_seg_size: int
    bootstrap_lsn: Lsn


def parse_size(text: str) -> int:
    """``SHOW wal_segment_size`` text (``16MB``) as bytes."""
    units = {"kB": 1024, "MB": 1024**2, "GB": 1024**3}
    for unit, mult in units.items():
        if text.endswith(unit) and text[: -len(unit)].isdigit():
            return int(text[: -len(unit)]) * mult
    if text.isdigit():
        return int(text)
    raise RemoteProtocolError(f"cannot parse size {text!r}")


@attrs.define
class Backoff:
    """Delays between the attempts of one retry loop: ``MIN_BACKOFF_S`` doubling up to ``cap``
    while attempts keep failing; ``reset()`` once one made progress, so a new failure after an
    old outage is retried at once. ``attempt`` counts the failures in a row (for the logs)."""

    cap: float
    delay: float = MIN_BACKOFF_S
    attempt: int = 0

    def reset(self) -> None:
        self.delay = MIN_BACKOFF_S
        self.attempt = 0

    def next_delay(self) -> float:
        """Count a failure; the delay to wait before the next attempt."""
        delay = self.delay
        self.delay = min(delay * 2, self.cap)
        self.attempt += 1
        return delay


class _Signal:
    """An edge-triggered wakeup: a waiter takes ``event`` *before* checking the state it waits
    on, then awaits it, so a ``fire()`` in between is never lost."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = trio.Event()

    def fire(self) -> None:
        self.event.set()
        self.event = trio.Event()


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


# ---------------------------------------------------------------------------------------------
# The bridge


class Bridge:
    """Runs terms until cancelled; ``statistics()`` tells where it is."""

    def __init__(self, cfg: BridgeConfig, connect: Connector) -> None:
        if not cfg.safekeepers:
            raise ValueError("no safekeepers configured")
        self.cfg = cfg
        self._connect = connect
        self.info: PostgresInfo | None = None
        n = len(cfg.safekeepers)
        self.proposer = Proposer(n, bootstrap_lsn=INVALID_LSN)
        self.buffer = WalBuffer(INVALID_LSN, cfg.buffer_bytes)
        self._pending: list[deque[VoteRequest | ProposerElected]] = [deque() for _ in range(n)]
        self._wake = [_Signal() for _ in range(n)]
        self._commit_changed = _Signal()
        self._elected = trio.Event()
        self.terms_run = 0
        self.reported_flush_lsn = INVALID_LSN
        self.slot_lsn = INVALID_LSN
        self._status_requested = False
        # Whether the current connection made progress (see the reconnect loops' back-off).
        self._sk_progress = [False] * n
        # The commit_lsn each safekeeper last reported (sync_safekeepers waits on a quorum).
        self._sk_commit = [INVALID_LSN] * n
        self._sk_commit_changed = _Signal()
        # sync-safekeepers: the donor safekeeper is the WAL source instead of PostgreSQL.
        self._sync_donor: int | None = None
        self._pg_progress = False
        # Whether the current term moved commit_lsn (the term loop's back-off resets then).
        self._term_progress = False
        # The last failure of the PostgreSQL stream and of a term, for statistics() and tests.
        self.last_postgres_error: BaseException | None = None
        self.last_term_error: BaseException | None = None
        # The newest pageserver feedback the safekeepers relayed (whichever pageserver holds
        # the tenant now streams from them: after a migration, the new one).
        self.pageserver_feedback: PageserverFeedback | None = None

    # -- public --------------------------------------------------------------------------------

    def statistics(self) -> dict[str, object]:
        p = self.proposer
        return {
            "term": p.term,
            "elected": p.elected,
            "commit_lsn": format_lsn(p.commit_lsn),
            "reported_flush_lsn": format_lsn(self.reported_flush_lsn),
            "slot_lsn": format_lsn(self.slot_lsn),
            "buffer": [format_lsn(self.buffer.start), format_lsn(self.buffer.end)],
            "terms_run": self.terms_run,
            "pageserver_feedback": None if (fb := self.pageserver_feedback) is None else {
                "last_received_lsn": format_lsn(fb.last_received_lsn),
                "disk_consistent_lsn": format_lsn(fb.disk_consistent_lsn),
                "remote_consistent_lsn": format_lsn(fb.remote_consistent_lsn),
                "replytime": fb.replytime,
            },
            "last_term_error": None if self.last_term_error is None else repr(self.last_term_error),
            "last_postgres_error": (
                None if self.last_postgres_error is None else repr(self.last_postgres_error)
            ),
            "safekeepers": [
                {
                    "addr": str(self.cfg.safekeepers[i]),
                    "phase": s.phase.value,
                    "flush_lsn": format_lsn(s.acked_flush_lsn),
                    "streaming_at": None if s.streaming_at is None else format_lsn(s.streaming_at),
                }
                for i, s in enumerate(p.slots)
            ],
        }

    async def wait_commit(self, lsn: Lsn) -> None:
        """Wait until a quorum has flushed ``lsn`` (tests and tools use it)."""
        while self.proposer.commit_lsn < lsn:
            await self._commit_changed.event.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        backoff = 0.1
        while True:
            try:
                self.info = await self._prepare_postgres()
                break
            except CONNECTION_ERRORS as exc:
                # PostgreSQL may still be starting (or restarting): wait for it.
                log.warning("postgres not reachable", error=repr(exc))
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_backoff_s)
        log.info(
            "postgres ready",
            system_id=self.info.system_id,
            pg_version=self.info.pg_version,
            bootstrap_lsn=format_lsn(self.info.bootstrap_lsn),
        )
        task_status.started()
        min_term = 0
        term_backoff = Backoff(self.cfg.max_backoff_s)
        while True:
            started = trio.current_time()
            self._term_progress = False
            try:
                await self._run_term(self.info, min_term)
            except* ProposerRejected as eg:
                rejected = [e for e in _leaves(eg) if isinstance(e, ProposerRejected)]
                min_term = max(min_term, *(e.seen_term for e in rejected))
                delay = self._term_backoff(term_backoff, started)
                self.last_term_error = rejected[0]
                log.warning("term lost, starting over", reason=str(rejected[0]), min_term=min_term,
                            **self._term_context(term_backoff, delay))
            except* Exception as eg:
                # A bug in one session must not leave PostgreSQL without its synchronous standby
                # for good: report it loudly, then start a new term (a new election). Backing off:
                # a bug that fails every term must not turn into an election storm.
                delay = self._term_backoff(term_backoff, started)
                self.last_term_error = next(_leaves(eg))
                log.error("term failed, starting over", exc_info=eg,
                          **self._term_context(term_backoff, delay))
                min_term = max(min_term, self.proposer.term)
            await trio.sleep(delay)

    def _term_backoff(self, backoff: Backoff, started: float) -> float:
        if self._term_progress or trio.current_time() - started >= self.cfg.max_backoff_s:
            backoff.reset()  # the term worked (commits, or it lived a while): a new failure
        return backoff.next_delay()

    def _term_context(self, backoff: Backoff, delay: float) -> dict[str, object]:
        p = self.proposer
        return {
            "term": p.term,
            "elected": p.elected,
            "commit_lsn": format_lsn(p.commit_lsn),
            "failures_in_a_row": backoff.attempt,
            "retry_in_s": delay,
        }

    async def sync_safekeepers(self, info: PostgresInfo) -> Lsn:
        """Neon's ``--sync-safekeepers``, before a compute starts: win a term without PostgreSQL
        and commit the WAL the safekeepers already hold, up to the donor's end; returns that LSN.

        A compute that died (kill -9, a crashed machine) leaves its last WAL flushed on the
        safekeepers but not committed there: the commit position rides on the *next*
        AppendRequest. Safekeepers send the pageserver committed WAL only, so without a new
        term the pageserver never gets that tail, and a compute cannot start on top of it.
        The election's donor ends at E (the highest last-log-term, then flush); a quorum that
        acknowledges E in the new term, which commits E; voters behind E get the missing WAL
        from the donor safekeeper (``START_REPLICATION ... (term='N')``) instead of PostgreSQL.
        ``info`` carries the timeline's system id and version (from the safekeepers) and
        ``bootstrap_lsn`` INVALID_LSN: safekeepers holding nothing is the caller's error.
        """
        self.info = info
        min_term = 0
        backoff = Backoff(self.cfg.max_backoff_s)
        while True:
            try:
                return await self._sync_term(info, min_term)
            except* ProposerRejected as eg:
                rejected = [e for e in _leaves(eg) if isinstance(e, ProposerRejected)]
                min_term = max(min_term, *(e.seen_term for e in rejected))
                # A rival proposer: backing off gives one of us the chance to finish.
                delay = backoff.next_delay()
                self.last_term_error = rejected[0]
                log.warning("term lost, starting over", reason=str(rejected[0]), min_term=min_term,
                            failures_in_a_row=backoff.attempt, retry_in_s=delay)
            await trio.sleep(delay)

    async def _sync_term(self, info: PostgresInfo, min_term: int) -> Lsn:
        n = len(self.cfg.safekeepers)
        self._sync_donor = None
        self.terms_run += 1
        self.proposer = p = Proposer(n, bootstrap_lsn=INVALID_LSN, min_term=min_term)
        self._pending = [deque() for _ in range(n)]
        self._elected = trio.Event()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(self._safekeeper_loop, i, info)
            await self._elected.wait()
            assert p.election is not None
            end = p.election.epoch_start_lsn
            if end == INVALID_LSN:
                raise LocalProtocolError("sync-safekeepers: the safekeepers hold no WAL of the timeline")
            # Voters behind the donor get its WAL from the donor itself (no PostgreSQL here).
            self._sync_donor = p.election.donor
            nursery.start_soon(self._donor_stream)
            # commit_lsn reaches E once a quorum acknowledged E in our term; it reaches the
            # safekeepers on the next AppendRequests, and they confirm it in their answers.
            while True:
                woken = self._sk_commit_changed.event
                if sum(c >= end for c in self._sk_commit) >= quorum_size(n):
                    break
                await woken.wait()
            log.info("safekeepers synced", term=p.term, commit_lsn=format_lsn(end))
            nursery.cancel_scope.cancel()
        return end

    # -- PostgreSQL setup ----------------------------------------------------------------------

    async def _pg_connect(self, application_name: str) -> PgConnection:
        params = {
            "user": self.cfg.pg_user,
            "replication": "true",
            "application_name": application_name,
        }
        with trio.fail_after(self.cfg.connect_timeout_s):
            return await self._connect(self.cfg.pg_host, self.cfg.pg_port, params)

    async def _prepare_postgres(self) -> PostgresInfo:
        """System id, version, segment size; the slot; where a fresh timeline's WAL starts."""
        conn = await self._pg_connect(f"{self.cfg.application_name}_setup")
        try:
            (ident,) = await conn.query(IdentifySystem().to_sql())
            system_id = int(ident[0] or 0)
            ((version,),) = await conn.query("SHOW server_version_num")
            ((seg,),) = await conn.query("SHOW wal_segment_size")
            slot = await self._ensure_slot(conn)
        finally:
            await conn.aclose()
        self.slot_lsn = slot
        bootstrap = self.cfg.start_lsn if self.cfg.start_lsn is not None else slot
        return PostgresInfo(system_id, int(version or 0), parse_size(seg or ""), bootstrap)

    async def _ensure_slot(self, conn: PgConnection) -> Lsn:
        name = self.cfg.slot_name
        rows = await conn.query(ReadReplicationSlot(name).to_sql())
        if not rows or rows[0][0] is None:
            # RESERVE_WAL pins WAL from the last checkpoint's redo point: a record start that
            # PostgreSQL still has, where a fresh timeline can begin.
            await conn.query(CreateReplicationSlot(name, reserve_wal=True).to_sql())
            log.info("created physical replication slot", slot=name)
            rows = await conn.query(ReadReplicationSlot(name).to_sql())
        if not rows or rows[0][0] != "physical" or rows[0][1] is None:
            raise LocalProtocolError(f"slot {name!r} is not a physical slot holding WAL: {rows!r}")
        return parse_lsn(rows[0][1])

    # -- one term ------------------------------------------------------------------------------

    async def _run_term(self, info: PostgresInfo, min_term: int) -> None:
        n = len(self.cfg.safekeepers)
        self.terms_run += 1
        self.proposer = Proposer(n, bootstrap_lsn=info.bootstrap_lsn, min_term=min_term)
        self._pending = [deque() for _ in range(n)]
        self._elected = trio.Event()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(self._safekeeper_loop, i, info)
            nursery.start_soon(self._postgres_loop)
            nursery.start_soon(self._slot_keeper)

    async def _safekeeper_loop(self, i: int, info: PostgresInfo) -> None:
        addr = self.cfg.safekeepers[i]
        backoff = MIN_BACKOFF_S
        slog = log.bind(safekeeper=str(addr))
        while True:
            started = trio.current_time()
            self._sk_progress[i] = False
            try:
                await self._safekeeper_session(i, info)
            except* CONNECTION_ERRORS as eg:
                slog.info("safekeeper connection lost", error=repr(next(_leaves(eg))))
            finally:
                if self._sk_progress[i] or trio.current_time() - started >= self.cfg.max_backoff_s:
                    # The connection worked (acknowledged WAL, or lived a while): this is a new
                    # failure, not the same outage going on, so reconnect quickly. A session that
                    # fails as soon as it starts (say, its catch-up cannot get WAL) keeps backing off.
                    backoff = MIN_BACKOFF_S
                if self.proposer.slots[i].phase is not Phase.OFFLINE:
                    self.proposer.disconnected(i)
                self._pending[i].clear()
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.max_backoff_s)

    def _safekeeper_auth(self) -> dict[str, str]:
        """The token (as the password) and the CA (TLS) of the safekeeper connections."""
        extra: dict[str, str] = {}
        if self.cfg.auth_token is not None:
            extra["password"] = self.cfg.auth_token
        if self.cfg.ssl_ca_file is not None:
            extra["sslrootcert"] = self.cfg.ssl_ca_file
        return extra

    async def _safekeeper_session(self, i: int, info: PostgresInfo) -> None:
        addr = self.cfg.safekeepers[i]
        params = {
            "dbname": "replication",
            "application_name": self.cfg.application_name,
            "options": f"-c timeline_id={self.cfg.timeline_id} tenant_id={self.cfg.tenant_id}",
            **self._safekeeper_auth(),
        }
        with trio.fail_after(self.cfg.connect_timeout_s):
            conn = await self._connect(addr.host, addr.port, params)
        try:
            with trio.fail_after(self.cfg.connect_timeout_s):
                copy = await conn.copy_both(StartWalPush(PROTO_VERSION, True).to_sql())
                greeting = ProposerGreeting(
                    tenant_id=self.cfg.tenant_id,
                    timeline_id=self.cfg.timeline_id,
                    pg_version=info.pg_version,
                    system_id=info.system_id,
                    wal_seg_size=info.wal_seg_size,
                )
                await copy.send(encode_message(greeting, PROTO_VERSION))
            self.proposer.connected(i)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._safekeeper_reader, i, copy)
                nursery.start_soon(self._safekeeper_sender, i, copy)
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async def _safekeeper_reader(self, i: int, copy: CopyStream) -> None:
        p = self.proposer
        while True:
            # A silent safekeeper is a dead one: heartbeats make it answer at least that often.
            with trio.fail_after(max(10 * self.cfg.heartbeat_s, self.cfg.connect_timeout_s)):
                payload = await receive_payload(copy)
            msg = decode_acceptor_message(payload, PROTO_VERSION)
            match msg:
                case AcceptorGreeting():
                    log.info("acceptor greeting", i=i, node_id=msg.node_id, term=msg.term)
                    out = p.on_greeting(i, msg)
                case VoteResponse():
                    was_elected = p.elected
                    out = p.on_vote(i, msg)
                    if p.election is not None and not was_elected:
                        self._on_elected(out)
                case AppendResponse():
                    acked = p.slots[i].acked_flush_lsn
                    if p.on_append_response(i, msg):
                        self._on_commit()
                    if p.slots[i].acked_flush_lsn > acked:
                        self._sk_progress[i] = True
                    fb = msg.pageserver_feedback
                    if fb is not None and (self.pageserver_feedback is None
                                           or fb.replytime >= self.pageserver_feedback.replytime):
                        self.pageserver_feedback = fb
                    if msg.commit_lsn > self._sk_commit[i]:
                        self._sk_commit[i] = msg.commit_lsn
                        self._sk_commit_changed.fire()
                    out = []
            for j, m in out:
                self._pending[j].append(m)
                self._wake[j].fire()

    def _on_elected(self, out: Sequence[tuple[int, VoteRequest | ProposerElected]]) -> None:
        election = self.proposer.election
        assert election is not None
        starts = [m.start_streaming_at for _, m in out if isinstance(m, ProposerElected)]
        # The window starts at the lowest position a voter needs; later voters below it catch
        # up on their own stream.
        self.buffer = WalBuffer(Lsn(min(starts)), self.cfg.buffer_bytes)
        log.info(
            "elected",
            term=election.term,
            epoch_start_lsn=format_lsn(election.epoch_start_lsn),
            donor=str(self.cfg.safekeepers[election.donor]),
            stream_from=format_lsn(self.buffer.start),
            history=[(e.term, format_lsn(e.lsn)) for e in election.term_history],
        )
        self._elected.set()

    def _on_commit(self) -> None:
        self._term_progress = True
        for w in self._wake:
            w.fire()
        self._commit_changed.fire()

    async def _safekeeper_sender(self, i: int, copy: CopyStream) -> None:
        p = self.proposer
        slot = p.slots[i]
        last_commit_sent = -1
        last_sent_at = trio.current_time()
        while True:
            woken = self._wake[i].event
            while self._pending[i]:
                await copy.send(encode_message(self._pending[i].popleft(), PROTO_VERSION))
            if slot.phase is Phase.ACTIVE:
                assert slot.streaming_at is not None
                if slot.streaming_at < self.buffer.start:
                    await self._catch_up(i, copy)
                    continue
                # The window may move while we send (its reader appends and trims): re-check
                # the position before each read, and fall back to catching up.
                while slot.streaming_at >= self.buffer.start:
                    begin, end = p.next_append(i, self.buffer.end)
                    heartbeat_due = trio.current_time() - last_sent_at >= self.cfg.heartbeat_s
                    if begin == end and p.commit_lsn == last_commit_sent and not heartbeat_due:
                        break
                    # A voter may start above the window's end (the window starts at the lowest
                    # voter's position and PostgreSQL has not filled it up to this one yet):
                    # then there is no WAL for it yet, only the heartbeat and commit_lsn.
                    wal = self.buffer.read(begin, end - begin) if end > begin else b""
                    await self._send_append(i, copy, begin, wal)
                    last_commit_sent = p.commit_lsn
                    last_sent_at = trio.current_time()
                    if end >= self.buffer.end:
                        break
            with trio.move_on_after(self.cfg.heartbeat_s):
                await woken.wait()

    async def _send_append(self, i: int, copy: CopyStream, begin: Lsn, wal: bytes) -> None:
        p = self.proposer
        end = Lsn(begin + len(wal))
        req = AppendRequest(p.term, begin, end, p.commit_lsn, p.truncate_lsn, wal)
        # Recorded before the send: the answer may be read while send() still yields after its
        # last write, and the proposer refuses acknowledgements beyond what was sent. A failed
        # send ends the session, which forgets the position.
        p.sent(i, end)
        await copy.send(encode_append_request_header(req, PROTO_VERSION) + wal)

    async def _catch_up(self, i: int, copy: CopyStream) -> None:
        """Feed safekeeper ``i`` from its own PostgreSQL stream until it reaches the window."""
        slot = self.proposer.slots[i]
        assert slot.streaming_at is not None
        log.info(
            "safekeeper behind the window, catching up from postgres",
            i=i,
            at=format_lsn(slot.streaming_at),
            window_start=format_lsn(self.buffer.start),
        )
        pg, source = await self._open_wal_source(
            f"{self.cfg.application_name}_catchup_{i}", slot.streaming_at
        )
        try:
            while slot.streaming_at is not None and slot.streaming_at < self.buffer.start:
                msg = decode_server_copy_data(await receive_payload(source))
                if not isinstance(msg, XLogData):
                    continue
                data = memoryview(msg.data)
                skip = slot.streaming_at - msg.wal_start
                if skip < 0:
                    raise RemoteProtocolError(
                        f"catch-up stream jumped to {format_lsn(msg.wal_start)}, "
                        f"expected {format_lsn(slot.streaming_at)}"
                    )
                for off in range(skip, len(data), MAX_SEND_SIZE):
                    chunk = bytes(data[off : off + MAX_SEND_SIZE])
                    await self._send_append(i, copy, slot.streaming_at, chunk)
        finally:
            with trio.CancelScope(shield=True):
                await pg.aclose()

    async def _open_wal_source(self, application_name: str, start: Lsn) -> tuple[PgConnection, CopyStream]:
        """A replication stream of the timeline's WAL from ``start``: PostgreSQL's, or during
        sync-safekeepers the donor safekeeper's (``(term='N')``: its flushed WAL, while it is
        in our term)."""
        donor = self._sync_donor
        if donor is None:
            conn = await self._pg_connect(application_name)
            cmd = StartReplication(start)
        else:
            addr = self.cfg.safekeepers[donor]
            params = {
                "user": self.cfg.pg_user,
                "replication": "true",
                "application_name": application_name,
                "options": f"-c timeline_id={self.cfg.timeline_id} tenant_id={self.cfg.tenant_id}",
                **self._safekeeper_auth(),
            }
            with trio.fail_after(self.cfg.connect_timeout_s):
                conn = await self._connect(addr.host, addr.port, params)
            cmd = StartReplication(start, term=self.proposer.term)
        try:
            return conn, await conn.copy_both(cmd.to_sql())
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.aclose()
            raise

    async def _donor_stream(self) -> None:
        """sync-safekeepers' window filler: the donor's WAL, for voters behind it."""
        backoff = MIN_BACKOFF_S
        while True:
            try:
                conn, copy = await self._open_wal_source(
                    f"{self.cfg.application_name}_sync", self.buffer.end
                )
                try:
                    while True:
                        msg = decode_server_copy_data(await receive_payload(copy))
                        if isinstance(msg, XLogData):
                            if msg.wal_start > self.buffer.end:
                                raise RemoteProtocolError(
                                    f"donor safekeeper sent WAL at {format_lsn(msg.wal_start)}, "
                                    f"a gap after {format_lsn(self.buffer.end)}"
                                )
                            self.buffer.append(msg.wal_start, msg.data)
                            backoff = MIN_BACKOFF_S
                            for w in self._wake:
                                w.fire()
                finally:
                    with trio.CancelScope(shield=True):
                        await conn.aclose()
            except CONNECTION_ERRORS as exc:
                log.warning("donor WAL stream lost", error=repr(exc))
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.max_backoff_s)

    # -- the slot --------------------------------------------------------------------------

    def slot_target(self) -> Lsn:
        """Where the slot may move: the lowest flush any safekeeper acknowledged in this term,
        at most ``max_slot_lag_bytes`` behind commit_lsn, never past commit_lsn."""
        p = self.proposer
        lowest = min(s.acked_flush_lsn for s in p.slots)
        floor = p.commit_lsn - self.cfg.max_slot_lag_bytes
        return Lsn(min(max(lowest, floor, 0), p.commit_lsn))

    async def _slot_keeper(self) -> None:
        """Advance the physical slot so PostgreSQL keeps what a lagging safekeeper needs.

        The synchronous standby reports the *quorum* flush; a slot moved by those reports would
        let PostgreSQL drop WAL a minority safekeeper has not received yet. So the stream runs
        without the slot and this task moves the slot with ``pg_replication_slot_advance`` to
        the lowest acknowledged flush instead.
        """
        await self._elected.wait()
        conn: PgConnection | None = None
        try:
            while True:
                await trio.sleep(self.cfg.slot_interval_s)
                target = self.slot_target()
                if target <= self.slot_lsn:
                    continue
                try:
                    if conn is None:
                        params = {
                            "user": self.cfg.pg_user,
                            "dbname": "postgres",
                            "application_name": f"{self.cfg.application_name}_slot",
                        }
                        with trio.fail_after(self.cfg.connect_timeout_s):
                            conn = await self._connect(self.cfg.pg_host, self.cfg.pg_port, params)
                    await conn.query(
                        f"select pg_replication_slot_advance('{self.cfg.slot_name}', "
                        f"'{format_lsn(target)}')"
                    )
                    self.slot_lsn = target
                except PgError as exc:
                    if exc.sqlstate != sqlstate.UNDEFINED_OBJECT:
                        log.warning("could not advance the slot", error=repr(exc))
                        continue
                    await self._recreate_slot(exc)
                except CONNECTION_ERRORS as exc:
                    log.warning("could not advance the slot", error=repr(exc))
                    if conn is not None:
                        with trio.CancelScope(shield=True):
                            await conn.aclose()
                        conn = None
        finally:
            if conn is not None:
                with trio.CancelScope(shield=True):
                    await conn.aclose()

    async def _recreate_slot(self, exc: PgError) -> None:
        """The slot is gone (dropped by hand, or a data directory restored without it): without
        it PostgreSQL keeps no WAL for a lagging safekeeper. Create it again; it then holds WAL
        from PostgreSQL's last checkpoint on, so a safekeeper further behind may have lost
        what it needs (its catch-up reports that)."""
        log.error(
            "the replication slot disappeared; creating it again",
            slot=self.cfg.slot_name,
            error=exc.message,
            lowest_safekeeper_flush=format_lsn(min(s.acked_flush_lsn for s in self.proposer.slots)),
        )
        try:
            conn = await self._pg_connect(f"{self.cfg.application_name}_setup")
            try:
                self.slot_lsn = await self._ensure_slot(conn)
            finally:
                with trio.CancelScope(shield=True):
                    await conn.aclose()
        except CONNECTION_ERRORS as exc2:
            log.warning("could not create the slot again", error=repr(exc2))
            return
        log.info("replication slot created again", slot=self.cfg.slot_name,
                 restart_lsn=format_lsn(self.slot_lsn))

    # -- PostgreSQL stream ---------------------------------------------------------------------

    async def _postgres_loop(self) -> None:
        await self._elected.wait()
        backoff = Backoff(self.cfg.max_backoff_s)
        while True:
            started = trio.current_time()
            self._pg_progress = False
            try:
                await self._postgres_session()
            except* CONNECTION_ERRORS as eg:
                if self._pg_progress or trio.current_time() - started >= self.cfg.max_backoff_s:
                    backoff.reset()  # it worked: a new failure, reconnect quickly
                delay = backoff.next_delay()
                self.last_postgres_error = error = next(_leaves(eg))
                log.warning(
                    "postgres replication stream lost",
                    error=repr(error),
                    window_end=format_lsn(self.buffer.end),
                    term=self.proposer.term,
                    failures_in_a_row=backoff.attempt,
                    retry_in_s=delay,
                )
            await trio.sleep(delay)

    async def _postgres_session(self) -> None:
        conn = await self._pg_connect(self.cfg.application_name)
        try:
            start = self.buffer.end
            # No slot on the stream: the slot keeper moves it separately (see _slot_keeper).
            cmd = StartReplication(start)
            try:
                copy = await conn.copy_both(cmd.to_sql())
            except PgError as exc:
                election = self.proposer.election
                if "removed" not in exc.message or not election or len(self.buffer):
                    raise
                # A lagging voter needs WAL PostgreSQL no longer has. Serve the donor's position
                # from the window so the quorum can go on; the laggard's own catch-up stream
                # will keep reporting the loss.
                log.error("postgres lacks WAL a safekeeper needs", error=exc.message,
                          window_start=format_lsn(election.epoch_start_lsn))
                self.buffer.reset(Lsn(max(start, election.epoch_start_lsn)))
                raise
            log.info("streaming from postgres", start=format_lsn(start))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._postgres_status_sender, copy)
                while True:
                    msg = decode_server_copy_data(await receive_payload(copy))
                    if isinstance(msg, XLogData):
                        # One stream carries WAL from ``start`` on, each message continuing
                        # the last: anything else is PostgreSQL's fault (or a proxy's), and
                        # must not reach the safekeepers.
                        if msg.wal_start != self.buffer.end:
                            raise RemoteProtocolError(
                                f"postgres sent WAL at {format_lsn(msg.wal_start)} where its "
                                f"stream is at {format_lsn(self.buffer.end)} (a "
                                f"{'gap' if msg.wal_start > self.buffer.end else 'overlap'} "
                                f"in its XLogData)"
                            )
                        self.buffer.append(msg.wal_start, msg.data)
                        self._pg_progress = True
                        for w in self._wake:
                            w.fire()
                    elif isinstance(msg, PrimaryKeepalive) and msg.reply_requested:
                        # The status task is the stream's only writer; ask it to answer.
                        self._status_requested = True
                        self._commit_changed.fire()
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async def _postgres_status_sender(self, copy: CopyStream) -> None:
        due = False
        while True:
            woken = self._commit_changed.event
            if due or self._status_requested or self.proposer.commit_lsn > self.reported_flush_lsn:
                self._status_requested = False
                await self._send_status(copy)
            with trio.move_on_after(self.cfg.status_interval_s):
                await woken.wait()
            due = not woken.is_set()

    async def _send_status(self, copy: CopyStream) -> None:
        # Only WAL a quorum fsynced counts as flushed: that is what releases synchronous commits.
        # Never report less than before (a new term starts with no acknowledgements).
        flush = Lsn(max(self.proposer.commit_lsn, self.reported_flush_lsn))
        msg = StandbyStatusUpdate(flush, flush, flush, pg_now(), False)
        await copy.send(encode_copy_message(msg))
        self.reported_flush_lsn = flush

