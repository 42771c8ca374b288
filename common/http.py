"""A small HTTP/1.1 server on trio + h11 for each node's management API and ``/metrics``.

Adding routes (a node builds one ``Router`` and hands it to ``HttpServer``)::

    router = Router()

    @router.route("GET", "/v1/tenant/{tenant_id}/timeline")
    async def list_timelines(req: Request) -> object:
        tenant = state.tenants.get(req.params["tenant_id"])
        if tenant is None:
            raise HttpError(404, f"tenant {req.params['tenant_id']} not found")
        return [t.info() for t in tenant.timelines]      # attrs/dict/list -> JSON

    @router.route("POST", "/v1/tenant/{tenant_id}/timeline")
    async def create_timeline(req: Request) -> object:
        body = req.structure(TimelineCreateRequest)    # cattrs; bad body -> 400 naming the key
        return Response.json(created, status=201)

    add_metrics_route(router, registry)                # GET /metrics (common.metrics)
    server = HttpServer(router, host="127.0.0.1", port=9898)
    port = await nursery.start(server.serve)

Handlers return a ``Response``, or any value cattrs can unstructure (attrs classes, dicts,
lists; ``None`` becomes ``{}``) which is sent as JSON with status 200. Errors are JSON
``{"msg": ...}``: ``HttpError(status, msg)`` for expected ones, 404/405 from the router, 400
for malformed requests, 500 (logged with a traceback) for anything else.

Path patterns: literal segments and ``{name}`` segments (one whole segment each); the
first matching route in registration order wins. Connections are keep-alive (h11), with an
idle timeout and a request-body limit.

Auth (``HttpServer(..., auth=HttpAuth(verifier, service))``, docs/auth.md): every route except
the exact paths in ``HttpAuth.open_paths`` (``/v1/status``, ``/metrics``) needs
``Authorization: Bearer <jwt>``. The check is the server's, not each handler's, so a new
route cannot forget it: a route whose pattern has ``{tenant_id}`` is that tenant's operation,
any other route is node-wide (``pageserverapi`` / ``safekeeperdata`` only); with
``scope_of`` (the storage controller) the path alone names the scope a route needs
(``common.auth.check_scope``). No or a malformed
header: 401; a bad, expired or insufficient token: 403; one warning log line each, with the
peer and the reason. TLS: ``ssl_context`` makes the port HTTPS (TLS from the first byte).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
import cattrs
import cattrs.preconf.json
import h11
import structlog
import trio

from common.auth import AuthError, JwtVerifier, Scope, Service, check_permission, check_scope
from common.config import ConfigError, strict_primitives, structure_config
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId

log = structlog.get_logger("http")

T = TypeVar("T")
RECEIVE_SIZE = 64 * 1024

json_converter = cattrs.preconf.json.make_converter(forbid_extra_keys=True)
strict_primitives(json_converter)


class HttpError(Exception):
    """An error with an HTTP status; sent as ``{"msg": msg}``."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status
        self.msg = msg


@attrs.frozen
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # names lower-cased
    body: bytes
    params: dict[str, str] = attrs.field(factory=dict)

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"malformed JSON body: {exc}") from None
        except RecursionError:
            # json raises this (not ValueError) for deeply nested input: still the client's fault
            raise HttpError(400, "malformed JSON body: nested too deeply") from None

    def structure(self, cls: type[T]) -> T:
        """The JSON body as ``cls``; a bad body is a 400 naming the key (common.config rules)."""
        data = self.json()
        if not isinstance(data, dict):
            raise HttpError(400, "request body must be a JSON object")
        try:
            return structure_config(cls, data, converter=json_converter, source="request body")
        except ConfigError as exc:
            raise HttpError(400, str(exc)) from None


@attrs.frozen
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, value: object, status: int = 200) -> Response:
        data = json_converter.unstructure(value) if value is not None else {}
        return cls(status, json.dumps(data).encode())

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> Response:
        return cls(status, text.encode(), content_type)

    @classmethod
    def error(cls, status: int, msg: str) -> Response:
        return cls(status, json.dumps({"msg": msg}).encode())


Handler = Callable[[Request], Awaitable[object]]


@attrs.frozen
class _Route:
    method: str
    segments: tuple[str, ...]
    handler: Handler

    def match(self, parts: list[str]) -> dict[str, str] | None:
        if len(parts) != len(self.segments):
            return None
        params: dict[str, str] = {}
        for pattern, part in zip(self.segments, parts, strict=True):
            if pattern.startswith("{") and pattern.endswith("}"):
                if not part:
                    return None
                params[pattern[1:-1]] = unquote(part)
            elif pattern != part:
                return None
        return params


def _split(path: str) -> list[str]:
    return path.strip("/").split("/") if path.strip("/") else []


class Router:
    def __init__(self) -> None:
        self._routes: list[_Route] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        if not pattern.startswith("/"):
            raise ValueError(f"route pattern must start with '/': {pattern!r}")
        self._routes.append(_Route(method.upper(), tuple(_split(pattern)), handler))

    def route(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add(method, pattern, handler)
            return handler

        return register

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        parts = _split(path)
        allowed: list[str] = []
        for route in self._routes:
            params = route.match(parts)
            if params is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route.handler, params
            allowed.append(route.method)
        if allowed:
            raise HttpError(405, f"method {method} not allowed for {path} (allowed: {', '.join(sorted(set(allowed)))})")
        raise HttpError(404, f"no route for {method} {path}")


@attrs.frozen
class HttpAuth:
    """Token checking for one node's HTTP port (see the module docstring)."""

    verifier: JwtVerifier
    service: Service
    open_paths: frozenset[str] = frozenset({"/v1/status", "/metrics"})
    # The scope a request path needs, for a node whose routes each name one (the storage
    # controller); None: the tenant / node-wide rule of ``check_permission``.
    scope_of: Callable[[str], Scope] | None = None

    def check(self, request: Request, params: dict[str, str]) -> None:
        """Raise ``HttpError`` 401/403 unless the request's token covers it."""
        header = request.headers.get("authorization")
        if header is None:
            raise AuthError("missing", "missing authorization header")
        kind, sep, token = header.partition(" ")
        if not sep or kind != "Bearer" or not token or not token.isascii():
            raise AuthError("header", "malformed authorization header (want 'Bearer <jwt>')")
        claims = self.verifier.decode(token)
        if self.scope_of is not None:
            check_scope(claims, self.scope_of(request.path))
            return
        tenant: TenantId | None = None
        if "tenant_id" in params:
            try:
                tenant = TenantId.parse(params["tenant_id"])
            except RemoteProtocolError:
                # Not a tenant id: only a node-wide token may go on (to the handler's 400).
                tenant = None
        check_permission(self.service, claims, tenant)


@attrs.frozen
class HttpServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    idle_timeout_s: float = 60.0
    max_body_bytes: int = 16 * 1024 * 1024
    shutdown_timeout_s: float = 5.0


class HttpServer:
    def __init__(
        self,
        router: Router,
        config: HttpServerConfig | None = None,
        *,
        auth: HttpAuth | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.router = router
        self.config = config or HttpServerConfig()
        self.auth = auth
        self.ssl_context = ssl_context
        self.port: int | None = None
        self._shutting_down = trio.Event()

    def shutdown(self) -> None:
        self._shutting_down.set()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen; report the bound port; return after ``shutdown()`` (connections get
        ``shutdown_timeout_s`` to finish)."""
        listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = int(listeners[0].socket.getsockname()[1])
        log.info("http server listening", host=self.config.host, port=self.port)
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptor:
                acceptor.start_soon(self._accept, listeners, connections)
                task_status.started(self.port)
                await self._shutting_down.wait()
                acceptor.cancel_scope.cancel()
            connections.cancel_scope.deadline = trio.current_time() + self.config.shutdown_timeout_s

    async def _accept(self, listeners: list[trio.SocketListener], connections: trio.Nursery) -> None:
        await trio.serve_listeners(self._serve_socket, listeners, handler_nursery=connections)

    async def _serve_socket(self, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "unknown"
        if self.ssl_context is None:
            await self.serve_connection(stream, peer)
            return
        tls = trio.SSLStream(stream, self.ssl_context, server_side=True)
        try:
            with trio.fail_after(self.config.idle_timeout_s):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.info("TLS handshake failed", peer=peer, error=str(exc.__cause__ or exc))
            await trio.aclose_forcefully(stream)
            return
        await self.serve_connection(tls, peer)

    async def serve_connection(self, stream: trio.abc.Stream, peer: str = "memory") -> None:
        """Serve one keep-alive connection until the client closes it or goes idle."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            while True:
                request = await self._read_request(conn, stream)
                if request is None:
                    return
                response = await self._dispatch(request, peer)
                await self._send_response(conn, stream, response, head_only=request.method == "HEAD")
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with trio.move_on_after(1):
                    await self._send_response(
                        conn, stream, Response.error(exc.error_status_hint, f"bad request: {exc}")
                    )
        except HttpError as exc:  # body too large
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with trio.move_on_after(1):
                    await self._send_response(conn, stream, Response.error(exc.status, exc.msg))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass
        except Exception:
            # Our bug, in this connection only: it must not take the listener (and the node
            # that runs it) down with it.
            log.error("http connection failed", exc_info=True)
        finally:
            await trio.aclose_forcefully(stream)

    async def _next_event(self, conn: h11.Connection, stream: trio.abc.Stream) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.fail_after(self.config.idle_timeout_s):
                data = await stream.receive_some(RECEIVE_SIZE)
            conn.receive_data(bytes(data))

    async def _read_request(self, conn: h11.Connection, stream: trio.abc.Stream) -> Request | None:
        event = await self._next_event(conn, stream)
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError(f"expected a request, got {type(event).__name__}")
        body = bytearray()
        while True:
            part = await self._next_event(conn, stream)
            if isinstance(part, h11.Data):
                body += part.data
                if len(body) > self.config.max_body_bytes:
                    raise HttpError(413, f"request body larger than {self.config.max_body_bytes} bytes")
            elif isinstance(part, h11.EndOfMessage):
                break
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(part).__name__} in a request")
        try:
            target = urlsplit(event.target.decode("ascii", "replace"))
        except ValueError as exc:  # "//[x": an unbalanced IPv6 bracket in the authority
            raise h11.RemoteProtocolError(f"bad request target: {exc}", 400) from None
        return Request(
            method=event.method.decode("ascii", "replace").upper(),
            path=target.path or "/",
            query=dict(parse_qsl(target.query)),
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers},
            body=bytes(body),
        )

    async def _dispatch(self, request: Request, peer: str = "memory") -> Response:
        try:
            handler, params = self.router.resolve(request.method, request.path)
            if self.auth is not None and request.path not in self.auth.open_paths:
                try:
                    self.auth.check(request, params)
                except AuthError as exc:
                    log.warning("http request refused", peer=peer, method=request.method,
                                path=request.path, kind=exc.kind, reason=exc.reason)
                    status = 401 if exc.kind in ("missing", "header") else 403
                    word = "Unauthorized" if status == 401 else "Forbidden"
                    return Response.error(status, f"{word}: {exc.public}")
            result = await handler(attrs.evolve(request, params=params))
            if isinstance(result, Response):
                return result
            return Response.json(result)
        except HttpError as exc:
            return Response.error(exc.status, exc.msg)
        except Exception as exc:
            log.error("http handler failed", method=request.method, path=request.path, exc_info=True)
            return Response.error(500, f"internal error: {exc}")

    async def _send_response(
        self, conn: h11.Connection, stream: trio.abc.Stream, response: Response, *, head_only: bool = False
    ) -> None:
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            *response.headers,
        ]
        out = conn.send(h11.Response(status_code=response.status, headers=headers)) or b""
        if response.body and not head_only:
            out += conn.send(h11.Data(data=response.body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
