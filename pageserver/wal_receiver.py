"""The pageserver's WAL receiver: one trio task per timeline pulling WAL from a safekeeper.

It connects to one safekeeper at a time (``START_REPLICATION PHYSICAL X/Y`` with the
``tenant_id``/``timeline_id`` options, protocols.md §3.6), feeds the XLogData bytes to the WAL
stream decoder and hands the decoded records, in order, to the ingest: all the records one
XLogData message completes as one list to ``on_records`` (one await per ~900 records of a bulk
load instead of one per record), or one by one to ``on_record``; or it hands the decoder itself,
fed with the message, to ``on_wal``, which decodes and applies what it can in one go (the
ingest's fused path, ``WalIngest.ingest_decoder``) and says how many records it took and where
the last one ended. ``X/Y`` is the end of the last
record handed over, so a reconnection neither skips nor repeats a record handed over
completely, and the next session's first record must name the start of that record as its
``xl_prev`` (a safekeeper whose WAL diverged before it fails the session); when
``on_records`` fails part-way through a list, the next session starts at the beginning of
that list again, so the callee must skip records it already has (the ingest does:
records ending at or below ``last_record_lsn`` are skipped). ``wait_for_lsn`` waiters wake once
per list, when its last record has been handed over. Standby status updates tell the safekeeper how far the
pageserver got: write = last record received, flush = ``disk_consistent_lsn``, apply =
``remote_consistent_lsn`` (both from the injected ``progress`` callable).

Which safekeeper: before each session the receiver asks every safekeeper not in backoff
for its position (``IDENTIFY_SYSTEM``: a safekeeper answers its ``commit_lsn``, the end of
what it would stream; a vanilla PostgreSQL its flush position) and streams from the most
advanced one (ties: the next one in the list after the last used), on the connection it
probed. The safekeepers' commit positions differ: a commit position rides on the next
AppendRequest, so when the proposer goes away (a compute killed, or sync-safekeepers, which
stops once a quorum has the new commit position) one safekeeper can keep a lower
``commit_lsn`` for good, and streaming from it waits forever, with keepalives, for WAL that
the others would send. So, like Neon's ``lagging_wal_timeout``, a session that received no
WAL for ``lagging_wal_timeout_s`` asks the other safekeepers again and ends
(``SafekeeperLagging``) when one of them has committed past what this one sent; the next
session resumes at ``last_record_lsn`` on the more advanced one. A safekeeper left so
after it claimed a position it never sent a record towards goes into backoff like a failed
one: its claim would otherwise win every choice and starve the receiver.

On any failure (refused connection, a stream that ends, a safekeeper silent for
``idle_timeout_s``, WAL that does not decode) the safekeeper goes into an exponential backoff
of its own (reset by a session that hands over records) and the receiver chooses again among
the others; when every safekeeper is in backoff it sleeps until the first one is out of it.
A record the callee rejects as malformed (``RemoteProtocolError`` from it) is not such a
failure: every safekeeper sends the same WAL, so the receiver stops with ``WalIngestError``.
Cancellation stops it at once: connections are closed under a short shielded deadline.

WAL no safekeeper holds any more (they answer ``START_REPLICATION`` with 58P01, "segment
already removed": they trimmed it after the WAL backup stored it and the pageserver reported it
durable, and this pageserver is behind that, e.g. recreated from scratch) comes from remote
storage when ``remote_wal`` is given: the receiver downloads the backed-up segments
(``remote_storage.wal_layout``) from the one holding ``last_record_lsn`` on, one at a time, and
feeds them to the decoder in 128 KiB pieces as if they were XLogData, until the next segment is
not in the store. A record cut by that segment end stays in the decoder, and the next
safekeeper session starts at the end of what was fed (a segment boundary, which the
safekeepers keep) with that decoder, so no record is lost or handed over twice. A remote session that hands over
nothing (the store does not have the segment either) is a failure like a safekeeper's, logged
with both positions, and retried with backoff.

A vanilla PostgreSQL speaks the same replication protocol, so ``WalReceiver`` can pull from it
as well (tests use that).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import attrs
import structlog
import trio

from common import pgclient
from protocol.errors import PROTOCOL_VIOLATION, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn, parse_lsn
from protocol.pgwire.errors import PgError
from protocol.replication import (
    IdentifySystem,
    PrimaryKeepalive,
    StandbyStatusUpdate,
    StartReplication,
    XLogData,
    decode_server_copy_data,
    encode_copy_message,
    pg_now,
)
from protocol.wal.reader import EndOfWal, NeedData, WalStreamDecoder
from protocol.wal.record import DecodedRecord
from remote_storage import RemoteNotFoundError, RemoteStorage, RemoteStorageError
from remote_storage.retry import retry
from remote_storage.wal_layout import wal_segment_key

log = structlog.get_logger("wal_receiver")

class CopyStream(Protocol):
    async def receive(self) -> bytes | None: ...

    async def send(self, payload: bytes | bytearray | memoryview) -> None: ...


class PgConnection(Protocol):
    """The part of ``common.pgclient.PgClientConnection`` the receiver drives."""

    async def query(self, sql: str) -> list[tuple[str | None, ...]]: ...

    async def copy_both(self, sql: str) -> CopyStream: ...

    async def aclose(self) -> None: ...


Addr = tuple[str, int]
# (host, port, startup parameters: user, options, replication, application_name)
Connector = Callable[[str, int, dict[str, str]], Awaitable[PgConnection]]
OnRecord = Callable[[DecodedRecord], Awaitable[None]]
OnRecords = Callable[[list[DecodedRecord]], Awaitable[None]]


# takes every record the decoder can give from what was fed: (records taken, end of the last
# one, what stopped it)
OnWal = Callable[[WalStreamDecoder], Awaitable[tuple[int, Lsn, NeedData | EndOfWal]]]


# The production connector.
pgclient_connect: Connector = pgclient.connect_with_params


@attrs.frozen
class Progress:
    """What the pageserver has durably done with the WAL it received."""

    disk_consistent_lsn: Lsn
    remote_consistent_lsn: Lsn


ProgressFn = Callable[[], Progress]

# Pieces the backed-up segments are fed in (the size of a safekeeper's catch-up XLogData).
REMOTE_PIECE = 128 * 1024
# Attempts at one segment's download before the remote session gives up (and is retried).
REMOTE_ATTEMPTS = 4
# SQLSTATE of "requested WAL segment ... has already been removed" (undefined_file).
WAL_REMOVED = "58P01"


@attrs.frozen
class RemoteWal:
    """Where the safekeepers' WAL backup of one timeline is (``remote_storage.wal_layout``)."""

    storage: RemoteStorage
    tenant_id: TenantId
    timeline_id: TimelineId
    seg_size: int = WAL_SEGMENT_SIZE

    async def read_segment(self, segno: int) -> bytes | None:
        """The whole backed-up segment, or None when the store does not have it."""
        key = wal_segment_key(self.tenant_id, self.timeline_id, segno, self.seg_size)
        try:
            return await retry(lambda: self.storage.download(key), what=f"download {key}",
                               attempts=REMOTE_ATTEMPTS)
        except RemoteNotFoundError:
            return None

CONNECTION_ERRORS = pgclient.CONNECTION_ERRORS


class WalDecodeError(RemoteProtocolError):
    """The WAL from the safekeeper stopped decoding before the stream ended."""


class WalIngestError(Exception):
    """The callee rejected a record it received whole and intact (``RemoteProtocolError``
    from ``on_record(s)``: a body it cannot parse). Every safekeeper sends the same WAL, so
    reconnecting would fail the same way forever: the receiver stops (not a connection
    error), and its owner records the failure."""


class SafekeeperLagging(Exception):
    """The current safekeeper sent no WAL for ``lagging_wal_timeout_s`` while ``better`` has
    committed WAL past what it sent: the session ends and the receiver moves on."""

    def __init__(self, current: Addr, better: Addr, position: Lsn, received: Lsn) -> None:
        super().__init__(
            f"{_addr(current)} sent nothing past {format_lsn(received)}, while {_addr(better)} "
            f"has committed up to {format_lsn(position)}"
        )
        self.better = better
        self.position = position


@attrs.frozen
class WalReceiverConfig:
    safekeepers: tuple[Addr, ...]
    tenant_id: TenantId | None = None
    timeline_id: TimelineId | None = None
    application_name: str = "pageserver"
    user: str = "postgres"
    status_interval_s: float = 1.0
    idle_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    # No WAL for this long while another safekeeper has committed more: move there (Neon's
    # lagging_wal_timeout; also the interval of the look at the others while no WAL comes).
    lagging_wal_timeout_s: float = 3.0
    min_backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    # A safekeeperdata JWT sent as the password (safekeepers with auth on); repr=False: the
    # config may be logged, the token never.
    auth_token: str | None = attrs.field(default=None, repr=False)
    # A CA file: connect with TLS and verify the safekeeper's certificate against it.
    ssl_ca_file: str | None = None


class _Wakeup:
    """A request flag one task fires and another consumes."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = trio.Event()

    def fire(self) -> None:
        self.event.set()

    def consume(self) -> None:
        if self.event.is_set():
            self.event = trio.Event()


@attrs.define
class _Backoff:
    """One safekeeper's retry state: failed sessions in a row push ``retry_at`` out."""

    delay: float
    retry_at: float


@attrs.frozen
class _Probed:
    """A connection to a safekeeper that answered IDENTIFY_SYSTEM, and its position."""

    addr: Addr
    conn: PgConnection
    position: Lsn


class WalReceiver:
    """Pulls a timeline's WAL from ``cfg.safekeepers`` starting at ``start_lsn``."""

    def __init__(
        self,
        cfg: WalReceiverConfig,
        *,
        start_lsn: Lsn,
        on_record: OnRecord | None = None,
        on_records: OnRecords | None = None,
        on_wal: OnWal | None = None,
        connect: Connector = pgclient_connect,
        progress: ProgressFn | None = None,
        remote_wal: RemoteWal | None = None,
    ) -> None:
        if not cfg.safekeepers:
            raise ValueError("no safekeepers to receive WAL from")
        if sum(f is not None for f in (on_record, on_records, on_wal)) != 1:
            raise ValueError("give exactly one of on_record, on_records and on_wal")
        self.cfg = cfg
        self._connect = connect
        self._on_record = on_record
        self._on_records = on_records
        self._on_wal = on_wal
        self._progress = progress
        # End of the last record handed to on_record: where the next session starts.
        self.last_record_lsn = start_lsn
        # Where that record starts, once one was handed over: the next session's first record
        # must name it as xl_prev (a safekeeper whose WAL diverged before it is refused).
        self._last_record_start: Lsn | None = None
        self.records_received = 0
        self.sessions = 0
        # Sessions ended because another safekeeper was ahead (SafekeeperLagging).
        self.lagging_switches = 0
        self.current: Addr | None = None
        # The last failure seen (a session's or a probe's), for the timeline's status.
        self.last_error: str | None = None
        self._advanced = trio.Event()
        self._backoff: dict[Addr, _Backoff] = {}
        # Index in cfg.safekeepers after the last one used: ties go there first (round robin).
        self._next = 0
        self._remote = remote_wal
        # Set when a safekeeper said the WAL at last_record_lsn is removed: read the backup.
        self._read_remote = False
        # The decoder a remote session left with a record cut at a segment end: the next
        # safekeeper session continues it at its fed_lsn (once; dropped on failure).
        self._carry: WalStreamDecoder | None = None
        self.remote_sessions = 0
        self.remote_segments = 0  # backed-up segments fed from remote storage

    async def wait_for_lsn(self, lsn: Lsn) -> None:
        """Wait until a record ending at or after ``lsn`` has been handed over."""
        while self.last_record_lsn < lsn:
            await self._advanced.wait()

    async def run(self) -> None:
        """Receive forever (until cancelled), from the most advanced safekeeper at hand."""
        while True:
            if self._read_remote and self._remote is not None:
                self._read_remote = False
                await self._remote_session()
            chosen = await self._choose()
            if chosen is None:
                # Every safekeeper failed lately: wait for the first one out of backoff.
                await trio.sleep_until(min(b.retry_at for b in self._backoff.values()))
                continue
            addr = chosen.addr
            self._next = (self.cfg.safekeepers.index(addr) + 1) % len(self.cfg.safekeepers)
            before = self.records_received
            failed = False
            try:
                await self._session(chosen)
            except* SafekeeperLagging as eg:
                exc = _first_leaf(eg)
                self.lagging_switches += 1
                log.info("wal receiver leaving a lagging safekeeper", safekeeper=_addr(addr),
                         reason=str(exc), at=format_lsn(self.last_record_lsn))
                if self.records_received == before and chosen.position > self.last_record_lsn:
                    # It claimed WAL it never sent (garbage, or a commit_lsn ahead of its own
                    # WAL): left unpenalised, its claim would win every choice and starve us.
                    failed = True
                    self._failed(addr, RemoteProtocolError(
                        f"answered IDENTIFY_SYSTEM {format_lsn(chosen.position)} but sent no "
                        f"record past {format_lsn(self.last_record_lsn)}",
                        sqlstate=PROTOCOL_VIOLATION,
                    ), "wal receiver distrusts a safekeeper")
            except* CONNECTION_ERRORS as eg:
                failed = True
                leaf = _first_leaf(eg)
                self._failed(addr, leaf, "wal receiver session ended")
                if isinstance(leaf, PgError) and leaf.sqlstate == WAL_REMOVED:
                    self._read_remote = True
            finally:
                self.current = None
            if self.records_received > before:
                self._backoff.pop(addr, None)
            elif failed:
                self._penalise(addr)

    def _failed(self, addr: Addr, exc: BaseException, event: str) -> None:
        self.last_error = f"{_addr(addr)}: {exc!r}"
        log.info(event, safekeeper=_addr(addr), error=repr(exc), at=format_lsn(self.last_record_lsn))

    def _penalise(self, addr: Addr) -> None:
        b = self._backoff.get(addr)
        delay = self.cfg.min_backoff_s if b is None else min(b.delay * 2, self.cfg.max_backoff_s)
        self._backoff[addr] = _Backoff(delay, trio.current_time() + delay)

    def _ready(self, addr: Addr) -> bool:
        b = self._backoff.get(addr)
        return b is None or b.retry_at <= trio.current_time()

    async def _choose(self) -> _Probed | None:
        """Probe the safekeepers out of backoff; the most advanced one's connection (the
        others are closed), or None when none answered."""
        n = len(self.cfg.safekeepers)
        candidates = [a for a in self.cfg.safekeepers if self._ready(a)]
        if not candidates:
            return None
        probed = await self._probe_all(candidates)
        if not probed:
            return None

        def rank(p: _Probed) -> tuple[Lsn, int]:
            # The highest position; among equals the first at or after _next (round robin).
            return p.position, -((self.cfg.safekeepers.index(p.addr) - self._next) % n)

        best = max(probed, key=rank)
        await _close_all([p.conn for p in probed if p is not best])
        return best

    async def _probe_all(self, addrs: Sequence[Addr]) -> list[_Probed]:
        """IDENTIFY_SYSTEM on each of ``addrs`` at once; a safekeeper that fails is logged,
        recorded as ``last_error`` and put in backoff."""
        probed: list[_Probed] = []

        async def probe(addr: Addr) -> None:
            try:
                probed.append(await self._probe(addr))
            except* CONNECTION_ERRORS as eg:
                self._failed(addr, _first_leaf(eg), "wal receiver probe failed")
                self._penalise(addr)

        try:
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(probe, addr)
        except BaseException:
            await _close_all([p.conn for p in probed])
            raise
        return probed

    async def _probe(self, addr: Addr) -> _Probed:
        with trio.fail_after(self.cfg.connect_timeout_s):
            conn = await self._connect(addr[0], addr[1], self._params())
            try:
                rows = await conn.query(IdentifySystem().to_sql())
                return _Probed(addr, conn, _identify_position(rows))
            except BaseException:
                await _close_all([conn])
                raise

    def _params(self) -> dict[str, str]:
        params = {"user": self.cfg.user, "replication": "true",
                  "application_name": self.cfg.application_name}
        if self.cfg.tenant_id is not None and self.cfg.timeline_id is not None:
            params["options"] = (
                f"-c timeline_id={self.cfg.timeline_id} tenant_id={self.cfg.tenant_id}"
            )
        if self.cfg.auth_token is not None:
            params["password"] = self.cfg.auth_token
        if self.cfg.ssl_ca_file is not None:
            params["sslrootcert"] = self.cfg.ssl_ca_file
        return params

    async def _session(self, chosen: _Probed) -> None:
        addr, conn = chosen.addr, chosen.conn
        self.sessions += 1
        self.current = addr
        try:
            carry, self._carry = self._carry, None
            if carry is not None and carry.position != self.last_record_lsn:
                carry = None  # (only a decoder that ended where the receiver is now)
            start = self.last_record_lsn if carry is None else carry.fed_lsn
            with trio.fail_after(self.cfg.connect_timeout_s):
                copy = await conn.copy_both(StartReplication(start).to_sql())
            log.info("receiving WAL", safekeeper=_addr(addr), start=format_lsn(start),
                     safekeeper_position=format_lsn(chosen.position),
                     continues_remote=carry is not None)
            decoder = carry or WalStreamDecoder(start, prev_lsn=self._last_record_start)
            reply = _Wakeup()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._status_sender, copy, reply)
                await self._receive(addr, copy, decoder, reply)
        finally:
            await _close_all([conn])

    async def _receive(
        self, addr: Addr, copy: CopyStream, decoder: WalStreamDecoder, reply: _Wakeup
    ) -> None:
        lag_timeout = self.cfg.lagging_wal_timeout_s if len(self.cfg.safekeepers) > 1 else math.inf
        last_message = trio.current_time()
        look_around_at = last_message + lag_timeout
        while True:
            if trio.current_time() >= look_around_at:
                # No WAL for lagging_wal_timeout_s: is another safekeeper ahead of this one?
                await self._leave_if_lagging(addr, decoder.fed_lsn)
                look_around_at = trio.current_time() + lag_timeout
            silent_at = last_message + self.cfg.idle_timeout_s
            # (A cancelled receive loses nothing: the client's buffer keeps partial messages.)
            with trio.move_on_at(min(silent_at, look_around_at)) as waiting:
                payload = await copy.receive()
            if waiting.cancelled_caught:
                if trio.current_time() >= silent_at:
                    raise trio.TooSlowError(
                        f"the safekeeper sent nothing for {self.cfg.idle_timeout_s:g} s"
                    )
                continue
            last_message = trio.current_time()
            if payload is None:
                raise EOFError("the safekeeper ended the stream")
            msg = _wal_message(payload)
            if isinstance(msg, PrimaryKeepalive):
                if msg.reply_requested:
                    reply.fire()
                continue
            if msg.wal_start != decoder.fed_lsn:
                raise WalDecodeError(
                    f"XLogData at {format_lsn(msg.wal_start)}, expected {format_lsn(decoder.fed_lsn)}"
                )
            await self._feed(decoder, msg.data)
            # Time spent handing WAL over is neither silence nor lag.
            last_message = trio.current_time()
            look_around_at = last_message + lag_timeout

    async def _feed(self, decoder: WalStreamDecoder, data: bytes | memoryview) -> None:
        """Feed one piece of WAL and hand over the records it completes."""
        decoder.feed(data)
        if self._on_wal is not None:
            stop = await self._take(self._on_wal, decoder)
        else:
            batch: list[DecodedRecord] = []
            stop = decoder.decode_into(batch)
            if batch:
                await self._hand_over(batch)
        if isinstance(stop, EndOfWal):
            raise WalDecodeError(
                f"WAL stopped decoding at {format_lsn(stop.error_lsn)}: {stop.reason}"
            )

    async def _remote_session(self) -> None:
        """Feed the backed-up segments from the one holding ``last_record_lsn`` on, until the
        store lacks the next one (see the module docstring)."""
        remote = self._remote
        assert remote is not None
        seg = remote.seg_size
        start = self.last_record_lsn
        self.remote_sessions += 1
        decoder = WalStreamDecoder(start, prev_lsn=self._last_record_start)
        segno = start // seg
        fed = 0
        log.info("reading WAL from remote storage", start=format_lsn(start),
                 segment=segno)
        try:
            while True:
                data = await remote.read_segment(segno)
                if data is None:
                    break
                if len(data) != seg:
                    raise WalDecodeError(
                        f"backed-up WAL segment {segno} has {len(data)} bytes, expected {seg}"
                    )
                view = memoryview(data)[decoder.fed_lsn - segno * seg:]
                for i in range(0, len(view), REMOTE_PIECE):
                    await self._feed(decoder, view[i : i + REMOTE_PIECE])
                self.remote_segments += 1
                fed += 1
                segno += 1
        except (RemoteStorageError, WalDecodeError) as exc:
            self.last_error = f"remote storage: {exc!r}"
            log.warning("reading WAL from remote storage failed", error=repr(exc),
                        at=format_lsn(self.last_record_lsn))
            return
        if fed == 0:
            self.last_error = (
                f"the WAL at {format_lsn(start)} is neither on a safekeeper nor in remote "
                f"storage (segment {segno} is not backed up)"
            )
            log.error("WAL not found anywhere", at=format_lsn(start), segment=segno)
            return
        if decoder.fed_lsn > decoder.position and decoder.position == self.last_record_lsn:
            self._carry = decoder
        log.info("read WAL from remote storage", start=format_lsn(start), segments=fed,
                 last_record_lsn=format_lsn(self.last_record_lsn),
                 fed_to=format_lsn(decoder.fed_lsn))

    async def _leave_if_lagging(self, current: Addr, received: Lsn) -> None:
        others = [a for a in self.cfg.safekeepers if a != current and self._ready(a)]
        if not others:
            return
        probed = await self._probe_all(others)
        await _close_all([p.conn for p in probed])
        ahead = [p for p in probed if p.position > received]
        if ahead:
            best = max(ahead, key=lambda p: p.position)
            raise SafekeeperLagging(current, best.addr, best.position, received)

    async def _take(self, on_wal: OnWal, decoder: WalStreamDecoder) -> NeedData | EndOfWal:
        try:
            n, end, stop = await on_wal(decoder)
        except RemoteProtocolError as exc:
            raise WalIngestError(
                f"ingest rejected WAL after {format_lsn(self.last_record_lsn)}: {exc}"
            ) from exc
        if n:
            self.last_record_lsn = end
            self._last_record_start = (
                decoder.last_record_start if decoder.position == end else None
            )
            self.records_received += n
            self._advanced.set()
            self._advanced = trio.Event()
        return stop

    async def _hand_over(self, batch: list[DecodedRecord]) -> None:
        try:
            if self._on_records is not None:
                await self._on_records(batch)
                self.last_record_lsn = batch[-1].end_lsn
                self._last_record_start = batch[-1].lsn
                self.records_received += len(batch)
            else:
                on_record = self._on_record
                assert on_record is not None
                for rec in batch:
                    await on_record(rec)
                    self.last_record_lsn = rec.end_lsn
                    self._last_record_start = rec.lsn
                    self.records_received += 1
        except RemoteProtocolError as exc:
            # (RemoteProtocolError is one of CONNECTION_ERRORS: it must not be retried here.)
            raise WalIngestError(
                f"ingest rejected WAL after {format_lsn(self.last_record_lsn)}: {exc}"
            ) from exc
        self._advanced.set()
        self._advanced = trio.Event()

    async def _status_sender(self, copy: CopyStream, reply: _Wakeup) -> None:
        # The only writer on this stream: the receive loop only fires ``reply``.
        while True:
            with trio.move_on_after(self.cfg.status_interval_s):
                await reply.event.wait()
            reply.consume()
            await copy.send(encode_copy_message(self.status_update()))

    def status_update(self) -> StandbyStatusUpdate:
        received = self.last_record_lsn
        if self._progress is not None:
            p = self._progress()
            flush, apply = p.disk_consistent_lsn, p.remote_consistent_lsn
        else:
            flush = apply = received
        return StandbyStatusUpdate(received, flush, apply, pg_now(), False)


def _wal_message(payload: bytes) -> XLogData | PrimaryKeepalive:
    msg = decode_server_copy_data(payload)
    assert isinstance(msg, XLogData | PrimaryKeepalive)
    return msg


def _addr(addr: Addr) -> str:
    return f"{addr[0]}:{addr[1]}"


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _identify_position(rows: list[tuple[str | None, ...]]) -> Lsn:
    """``xlogpos`` of an IDENTIFY_SYSTEM answer (systemid, timeline, xlogpos, dbname)."""
    if len(rows) != 1 or len(rows[0]) < 3 or rows[0][2] is None:
        raise RemoteProtocolError(
            f"IDENTIFY_SYSTEM answered {rows!r}, not one row with xlogpos",
            sqlstate=PROTOCOL_VIOLATION,
        )
    return parse_lsn(rows[0][2])


async def _close_all(conns: Sequence[PgConnection]) -> None:
    # Shielded with a short deadline each: closing must happen even when we are cancelled, and
    # a connection we are done with that fails to close has nothing left to lose.
    for conn in conns:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            try:
                await conn.aclose()
            except CONNECTION_ERRORS as exc:
                log.debug("closing a replication connection failed", error=repr(exc))


def parse_safekeepers(text: str | Sequence[str]) -> tuple[Addr, ...]:
    """``host:port,host:port`` (or a list of ``host:port``)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"safekeeper address {item!r} is not host:port")
        out.append((host, int(port)))
    return tuple(out)
