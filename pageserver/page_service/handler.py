"""The page service's query handler for the libpq server loop (``common.pgserver``).

Owns the commands on the pageserver's libpq port (protocols.md §1.5):

- ``pagestream_v2 <tenant> <timeline>`` / ``pagestream_v3 <tenant> <timeline>``: CopyBoth,
  then ``pipeline.serve_pagestream`` until the client ends the stream. The timeline is not
  looked up here but on the first request (as neon does), so opening a stream never fails for
  a missing timeline; the request does.
- ``set ...``: ``SELECT 1`` (psycopg's ``SET datestyle``).
- anything registered in ``extra_commands`` (e.g. ``basebackup`` from its own room).

Auth: each command but ``set`` is checked with ``conn.authorize`` against the tenant it names
(for extra commands: their first argument; none = a node-wide command), before it runs.

Query parsing follows neon: trim, split at the first space (a query without a space cannot be
parsed), match the command word case-insensitively, split the arguments on whitespace.

How a stream ends on the wire: CopyDone from the client -> CopyDone, CommandComplete,
ReadyForQuery (the loop does it); Terminate or EOF -> the connection closes; a bad message or
an unresolvable non-GetPage request -> ErrorResponse XX000 and ReadyForQuery; Reconnect (08006)
and Shutdown (57P01) -> a FATAL ErrorResponse, then the connection closes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import attrs
import trio

from common.pgserver import PgConnection
from pageserver.page_service.config import PageServiceConfig
from pageserver.page_service.metrics import PageServiceMetrics
from pageserver.page_service.pipeline import (
    DirectStreamIO,
    PagestreamContext,
    serve_pagestream,
)
from pageserver.page_service.reader import (
    PageReader,
    Reconnect,
    Shutdown,
    StreamEndingError,
)
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.pagestream import PagestreamVersion, Request, StreamEnd
from protocol.pgwire import sqlstate
from protocol.pgwire.errors import PgError


@attrs.frozen
class PagestreamCommand:
    version: PagestreamVersion
    tenant_id: TenantId
    timeline_id: TimelineId


@attrs.frozen
class SetCommand:
    text: str


@attrs.frozen
class OtherCommand:
    """A command word this module does not serve itself (dispatched via ``extra_commands``)."""

    name: str
    args: tuple[str, ...]


PageServiceCommand = PagestreamCommand | SetCommand | OtherCommand


def parse_query(query: str) -> PageServiceCommand:
    """Parse one simple query; ``PgError`` (XX000, as neon) if it cannot be parsed."""
    text = query.strip().rstrip(";").strip()
    word, sep, rest = text.partition(" ")
    if not sep:
        raise PgError(f"cannot parse query: {query[:200]!r}")
    name = word.lower()
    args = tuple(rest.split())
    if name in ("pagestream_v2", "pagestream_v3"):
        if len(args) != 2:
            raise PgError(f"{name} needs exactly 2 arguments: <tenant_id> <timeline_id>")
        try:
            tenant, timeline = TenantId.parse(args[0]), TimelineId.parse(args[1])
        except Exception as exc:  # RemoteProtocolError from the id parsers
            raise PgError(f"{name}: {exc}") from None
        return PagestreamCommand(3 if name == "pagestream_v3" else 2, tenant, timeline)
    if name == "set":
        return SetCommand(text)
    return OtherCommand(name, args)


def _leading_tenant(args: tuple[str, ...]) -> TenantId | None:
    if not args:
        return None
    try:
        return TenantId.parse(args[0])
    except RemoteProtocolError:
        return None


class TimelineLookup(Protocol):
    """Finds a timeline's reader; raises ``NotFound`` (or ``Shutdown``) when it cannot."""

    def get_reader(self, tenant_id: TenantId, timeline_id: TimelineId) -> PageReader: ...


class LazyResolver:
    """Resolves the connection's timeline on the first request, then always returns it."""

    def __init__(
        self, lookup: TimelineLookup, tenant_id: TenantId, timeline_id: TimelineId
    ) -> None:
        self._lookup = lookup
        self._tenant_id = tenant_id
        self._timeline_id = timeline_id
        self._reader: PageReader | None = None
        self.resolved = trio.Event()

    def resolve(self, request: Request) -> PageReader:
        if self._reader is None:
            self._reader = self._lookup.get_reader(self._tenant_id, self._timeline_id)
            self.resolved.set()
        return self._reader

    @property
    def constant(self) -> PageReader | None:
        """Once resolved, every request's reader (``SingleTimeline.constant``)."""
        return self._reader

    async def wait_shutdown(self) -> None:
        """Return when the resolved timeline shuts down (never, before it is resolved)."""
        await self.resolved.wait()
        assert self._reader is not None
        await self._reader.wait_shutdown()


ExtraCommand = Callable[[PgConnection, tuple[str, ...]], Awaitable[None]]


class PageServiceHandler:
    """``common.pgserver.QueryHandler`` for the pageserver's libpq port."""

    def __init__(
        self,
        lookup: TimelineLookup,
        config: PageServiceConfig | None = None,
        metrics: PageServiceMetrics | None = None,
        extra_commands: Mapping[str, ExtraCommand] | None = None,
    ) -> None:
        self.lookup = lookup
        self.config = config or PageServiceConfig()
        self.metrics = metrics
        self.extra_commands = dict(extra_commands or {})

    async def handle_query(self, conn: PgConnection, query: str) -> None:
        command = parse_query(query)
        match command:
            case SetCommand():
                await conn.send_command_complete("SELECT 1")
            case PagestreamCommand():
                conn.authorize(command.tenant_id)
                await self._pagestream(conn, command)
            case OtherCommand(name=name, args=args):
                # Every other command names its tenant first (basebackup, fullbackup, ...);
                # one that does not is node-wide: only a pageserverapi token passes.
                conn.authorize(_leading_tenant(args))
                run = self.extra_commands.get(name)
                if run is None:
                    raise PgError(f"unsupported command {name!r}", sqlstate.SYNTAX_ERROR)
                await run(conn, args)

    async def _pagestream(self, conn: PgConnection, command: PagestreamCommand) -> None:
        conn.bind_log(tenant_id=command.tenant_id.hex, timeline_id=command.timeline_id.hex)
        resolver = LazyResolver(self.lookup, command.tenant_id, command.timeline_id)
        ctx = PagestreamContext(
            command.version, resolver, self.config, self.metrics, shutdown=resolver.wait_shutdown
        )
        copy = await conn.enter_copy_both()
        # From here the pagestream reads the connection's bytes itself (DirectStreamIO): the
        # libpq loop's message objects cost more than serving a page from cache.
        io = DirectStreamIO(
            copy.transport,
            command.version,
            conn.take_receive_buffer(),
            idle_timeout_s=conn.server.config.idle_timeout_s,
        )
        try:
            end = await serve_pagestream(io, io, ctx)
        except RemoteProtocolError as exc:
            if exc.sqlstate == sqlstate.PROTOCOL_VIOLATION:
                # Broken framing: the byte stream cannot be resynchronised, end the connection.
                raise PgError(exc.msg, exc.sqlstate, severity="FATAL") from None
            # A bad request inside intact framing: the loop answers ErrorResponse and goes on
            # reading messages after it (skipping the rest of the COPY, as PostgreSQL does).
            conn.restore_receive_buffer(io.take_unread())
            raise
        except (Shutdown, Reconnect) as exc:
            # neon closes the connection after these; FATAL makes the loop do the same.
            raise PgError(str(exc), exc.sqlstate, severity="FATAL") from None
        except StreamEndingError as exc:
            conn.restore_receive_buffer(io.take_unread())
            raise PgError(str(exc), exc.sqlstate) from None
        if end is StreamEnd.COPY_DONE:
            copy.peer_done = True
            conn.restore_receive_buffer(io.take_unread())
        else:
            copy.peer_closed = True  # Terminate or EOF: the loop closes the connection
