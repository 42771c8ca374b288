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
completely; when ``on_records`` fails part-way through a list, the next session starts at the
beginning of that list again, so the callee must skip records it already has (the ingest does:
records ending at or below ``last_record_lsn`` are skipped). ``wait_for_lsn`` waiters wake once
per list, when its last record has been handed over. Standby status updates tell the safekeeper how far the
pageserver got: write = last record received, flush = ``disk_consistent_lsn``, apply =
``remote_consistent_lsn`` (both from the injected ``progress`` callable).

On any failure (refused connection, a stream that ends, a safekeeper silent for
``idle_timeout_s``, WAL that does not decode) it moves on to the next safekeeper in the list,
with exponential backoff once every safekeeper has failed in a row. A record the callee
rejects as malformed (``RemoteProtocolError`` from it) is not such a failure: every safekeeper
sends the same WAL, so the receiver stops with ``WalIngestError``. Cancellation stops it
at once: the connection is closed under a short shielded deadline.

A vanilla PostgreSQL speaks the same replication protocol, so ``WalReceiver`` can pull from it
as well (tests use that).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import attrs
import structlog
import trio

from common import pgclient
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn
from protocol.replication import (
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

log = structlog.get_logger("wal_receiver")


class CopyStream(Protocol):
    async def receive(self) -> bytes | None: ...

    async def send(self, payload: bytes | bytearray | memoryview) -> None: ...


class PgConnection(Protocol):
    """The part of ``common.pgclient.PgClientConnection`` the receiver drives."""

    async def copy_both(self, sql: str) -> CopyStream: ...

    async def aclose(self) -> None: ...


# (host, port, startup parameters: user, options, replication, application_name)
Connector = Callable[[str, int, dict[str, str]], Awaitable[PgConnection]]
OnRecord = Callable[[DecodedRecord], Awaitable[None]]
OnRecords = Callable[[list[DecodedRecord]], Awaitable[None]]
# takes every record the decoder can give: (records taken, end of the last one, what stopped it)
OnWal = Callable[[WalStreamDecoder], Awaitable[tuple[int, Lsn, NeedData | EndOfWal]]]


# The production connector.
pgclient_connect: Connector = pgclient.connect_with_params


@attrs.frozen
class Progress:
    """What the pageserver has durably done with the WAL it received."""

    disk_consistent_lsn: Lsn
    remote_consistent_lsn: Lsn


ProgressFn = Callable[[], Progress]

CONNECTION_ERRORS = pgclient.CONNECTION_ERRORS


class WalDecodeError(RemoteProtocolError):
    """The WAL from the safekeeper stopped decoding before the stream ended."""


class WalIngestError(Exception):
    """The callee rejected a record it received whole and intact (``RemoteProtocolError``
    from ``on_record(s)``: a body it cannot parse). Every safekeeper sends the same WAL, so
    reconnecting would fail the same way forever: the receiver stops (not a connection
    error), and its owner records the failure."""


@attrs.frozen
class WalReceiverConfig:
    safekeepers: tuple[tuple[str, int], ...]
    tenant_id: TenantId | None = None
    timeline_id: TimelineId | None = None
    application_name: str = "pageserver"
    user: str = "postgres"
    status_interval_s: float = 1.0
    idle_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    min_backoff_s: float = 0.05
    max_backoff_s: float = 5.0


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
        self.records_received = 0
        self.sessions = 0
        self.current: tuple[str, int] | None = None
        self.last_error: str | None = None
        self._advanced = trio.Event()

    async def wait_for_lsn(self, lsn: Lsn) -> None:
        """Wait until a record ending at or after ``lsn`` has been handed over."""
        while self.last_record_lsn < lsn:
            await self._advanced.wait()

    async def run(self) -> None:
        """Receive forever (until cancelled), switching safekeepers on failure."""
        n = len(self.cfg.safekeepers)
        index = 0
        failures_in_row = 0
        backoff = self.cfg.min_backoff_s
        while True:
            addr = self.cfg.safekeepers[index % n]
            before = self.records_received
            try:
                await self._session(addr)
            except* CONNECTION_ERRORS as eg:
                exc = eg.exceptions[0]
                while isinstance(exc, BaseExceptionGroup):
                    exc = exc.exceptions[0]
                self.last_error = f"{addr[0]}:{addr[1]}: {exc!r}"
                log.info("wal receiver session ended", safekeeper=f"{addr[0]}:{addr[1]}",
                         error=repr(exc), at=format_lsn(self.last_record_lsn))
            finally:
                self.current = None
            if self.records_received > before:
                failures_in_row = 0
                backoff = self.cfg.min_backoff_s
            else:
                failures_in_row += 1
            index += 1
            if failures_in_row >= n:
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_backoff_s)

    def _params(self) -> dict[str, str]:
        params = {"user": self.cfg.user, "replication": "true",
                  "application_name": self.cfg.application_name}
        if self.cfg.tenant_id is not None and self.cfg.timeline_id is not None:
            params["options"] = (
                f"-c timeline_id={self.cfg.timeline_id} tenant_id={self.cfg.tenant_id}"
            )
        return params

    async def _session(self, addr: tuple[str, int]) -> None:
        with trio.fail_after(self.cfg.connect_timeout_s):
            conn = await self._connect(addr[0], addr[1], self._params())
        self.sessions += 1
        self.current = addr
        try:
            start = self.last_record_lsn
            with trio.fail_after(self.cfg.connect_timeout_s):
                copy = await conn.copy_both(StartReplication(start).to_sql())
            log.info("receiving WAL", safekeeper=f"{addr[0]}:{addr[1]}", start=format_lsn(start))
            decoder = WalStreamDecoder(start)
            reply = _Wakeup()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._status_sender, copy, reply)
                await self._receive(copy, decoder, reply)
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await conn.aclose()

    async def _receive(self, copy: CopyStream, decoder: WalStreamDecoder, reply: _Wakeup) -> None:
        while True:
            with trio.fail_after(self.cfg.idle_timeout_s):
                payload = await copy.receive()
            if payload is None:
                raise EOFError("the safekeeper ended the stream")
            msg = decode_server_copy_data(payload)
            if isinstance(msg, PrimaryKeepalive):
                if msg.reply_requested:
                    reply.fire()
                continue
            assert isinstance(msg, XLogData)
            if msg.wal_start != decoder.fed_lsn:
                raise WalDecodeError(
                    f"XLogData at {format_lsn(msg.wal_start)}, expected {format_lsn(decoder.fed_lsn)}"
                )
            decoder.feed(msg.data)
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

    async def _take(self, on_wal: OnWal, decoder: WalStreamDecoder) -> NeedData | EndOfWal:
        try:
            n, end, stop = await on_wal(decoder)
        except RemoteProtocolError as exc:
            raise WalIngestError(
                f"ingest rejected WAL after {format_lsn(self.last_record_lsn)}: {exc}"
            ) from exc
        if n:
            self.last_record_lsn = end
            self.records_received += n
            self._advanced.set()
            self._advanced = trio.Event()
        return stop

    async def _hand_over(self, batch: list[DecodedRecord]) -> None:
        try:
            if self._on_records is not None:
                await self._on_records(batch)
                self.last_record_lsn = batch[-1].end_lsn
                self.records_received += len(batch)
            else:
                on_record = self._on_record
                assert on_record is not None
                for rec in batch:
                    await on_record(rec)
                    self.last_record_lsn = rec.end_lsn
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


def parse_safekeepers(text: str | Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port`` (or a list of ``host:port``)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"safekeeper address {item!r} is not host:port")
        out.append((host, int(port)))
    return tuple(out)
