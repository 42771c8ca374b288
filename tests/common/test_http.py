"""HTTP server: routing with path params, JSON bodies via cattrs, errors as {"msg"}, /metrics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import attrs
import prometheus_client
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from common.http import HttpError, HttpServer, HttpServerConfig, Request, Response, Router
from common.metrics import add_metrics_route, metrics_text, new_registry


@attrs.frozen
class TimelineCreate:
    new_timeline_id: str
    ancestor_start_lsn: str | None = None


@attrs.frozen
class TimelineInfo:
    tenant_id: str
    timeline_id: str


def make_router() -> tuple[Router, prometheus_client.CollectorRegistry]:
    router = Router()
    registry = new_registry()
    requests = prometheus_client.Counter(
        "pageserver_test_requests", "requests", ["route"], registry=registry
    )

    @router.route("GET", "/v1/tenant/{tenant_id}/timeline/{timeline_id}")
    async def get_timeline(req: Request) -> object:
        requests.labels("get").inc()
        if req.params["timeline_id"] == "missing":
            raise HttpError(404, "timeline missing not found")
        return TimelineInfo(req.params["tenant_id"], req.params["timeline_id"])

    @router.route("POST", "/v1/tenant/{tenant_id}/timeline")
    async def create_timeline(req: Request) -> object:
        body = req.structure(TimelineCreate)
        return Response.json({"created": body.new_timeline_id, "q": req.query}, status=201)

    @router.route("GET", "/v1/crash")
    async def crash(req: Request) -> object:
        raise RuntimeError("bug")

    @router.route("GET", "/v1/status")
    async def status(req: Request) -> object:
        return None

    add_metrics_route(router, registry)
    return router, registry


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    router, _ = make_router()
    server = HttpServer(router, HttpServerConfig(port=0))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        yield port
        server.shutdown()


async def request(
    port: int, method: str, path: str, body: bytes = b"", keep: trio.abc.Stream | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A minimal raw HTTP/1.1 client (so the test does not trust our own h11 glue twice)."""
    stream = keep or await trio.open_tcp_stream("127.0.0.1", port)
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    await stream.send_all(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    header, _, rest = data.partition(b"\r\n\r\n")
    lines = header.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    if keep is None:
        await stream.aclose()
    return status, headers, rest


async def test_routes_params_and_json(http_port: int) -> None:
    with trio.fail_after(30):
        status, headers, body = await request(http_port, "GET", "/v1/tenant/ab/timeline/cd")
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body) == {"tenant_id": "ab", "timeline_id": "cd"}
        status, _, body = await request(
            http_port, "POST", "/v1/tenant/ab/timeline?x=1", b'{"new_timeline_id": "ef"}'
        )
        assert status == 201 and json.loads(body) == {"created": "ef", "q": {"x": "1"}}
        status, _, body = await request(http_port, "GET", "/v1/status")
        assert (status, json.loads(body)) == (200, {})


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "msg"),
    [
        ("GET", "/v1/tenant/ab/timeline/missing", b"", 404, "timeline missing not found"),
        ("GET", "/nope", b"", 404, "no route for GET /nope"),
        ("DELETE", "/v1/tenant/ab/timeline/cd", b"", 405, "method DELETE not allowed"),
        ("POST", "/v1/tenant/ab/timeline", b"{nope", 400, "malformed JSON body"),
        ("POST", "/v1/tenant/ab/timeline", b"[" * 200_000, 400, "nested too deeply"),
        ("POST", "/v1/tenant/ab/timeline", b"\xff\xfe{}", 400, "malformed JSON body"),
        ("POST", "/v1/tenant/ab/timeline", b'{"zzz": 1}', 400, "zzz: unknown key"),
        ("POST", "/v1/tenant/ab/timeline", b'{"new_timeline_id": 5}', 400, "new_timeline_id: expected a string"),
        ("GET", "/v1/crash", b"", 500, "internal error: bug"),
    ],
)
async def test_errors_are_json_msg(
    http_port: int, method: str, path: str, body: bytes, status: int, msg: str
) -> None:
    with trio.fail_after(30):
        got_status, _, got = await request(http_port, method, path, body)
    assert got_status == status
    assert msg in json.loads(got)["msg"]


async def test_keep_alive_and_metrics(http_port: int) -> None:
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream("127.0.0.1", http_port)
        for _ in range(3):
            status, _, _ = await request(http_port, "GET", "/v1/tenant/a/timeline/b", keep=stream)
            assert status == 200
        status, headers, body = await request(http_port, "GET", "/metrics", keep=stream)
        await stream.aclose()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'pageserver_test_requests_total{route="get"} 3.0' in body.decode()


async def test_garbage_request_gets_400() -> None:
    router, _ = make_router()
    server = HttpServer(router)
    client, server_side = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_connection, server_side)
            await client.send_all(b"\x00\x01 garbage\r\n\r\n")
            data = b""
            while chunk := await client.receive_some(65536):
                data += chunk
    assert data.startswith(b"HTTP/1.1 400")
    assert b'"msg"' in data


@pytest.mark.parametrize("target", [b"//[x", b"http://[::1/v1/status", b"//a]b[/"])
async def test_unparsable_target_is_400_and_the_server_lives_on(http_port: int, target: bytes) -> None:
    """urlsplit refuses an unbalanced IPv6 bracket with ValueError: that is the client's bad
    request, not a reason to take the listener (and the node) down."""
    stream = await trio.open_tcp_stream("127.0.0.1", http_port)
    with trio.fail_after(10):
        await stream.send_all(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 400"), data
    assert b"bad request target" in data
    status, _, _ = await request(http_port, "GET", "/v1/status")
    assert status == 200


async def test_a_bug_in_one_connection_closes_only_that_one(
    http_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = HttpServer._read_request
    calls = 0

    async def flaky(self: HttpServer, conn: object, stream: trio.abc.Stream) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("bug while reading a request")
        return await real(self, conn, stream)  # type: ignore[arg-type]

    monkeypatch.setattr(HttpServer, "_read_request", flaky)
    with capture_logs() as logs:
        stream = await trio.open_tcp_stream("127.0.0.1", http_port)
        with trio.fail_after(10):
            await stream.send_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await stream.receive_some(65536) == b""  # closed, no answer
        await stream.aclose()
        status, _, _ = await request(http_port, "GET", "/v1/status")
    assert status == 200
    failed = [e for e in logs if e["event"] == "http connection failed"]
    assert len(failed) == 1 and failed[0]["log_level"] == "error" and failed[0]["exc_info"]


def test_metrics_text_is_per_registry() -> None:
    a, b = new_registry(), new_registry()
    prometheus_client.Gauge("safekeeper_x", "x", registry=a).set(2)
    assert b"safekeeper_x 2.0" in metrics_text(a)
    assert b"safekeeper_x" not in metrics_text(b)


_REQUEST_PIECES = [
    b"GET ", b"POST ", b"HEAD ", b"/v1/tenant/ab/timeline", b"/v1/crash", b"/%ff%00", b"\xff",
    b"//[x", b"//[::1]:x/", b"http://[", b"?a=%zz&&=",
    b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", b"Host: x\r\n", b"Content-Length: 7\r\n",
    b"Content-Length: -1\r\n", b"Content-Length: 99999999999999999999\r\n",
    b"Transfer-Encoding: chunked\r\n", b"Connection: close\r\n", b"Expect: 100-continue\r\n",
    b"\r\n", b"7\r\n{\"a\":1}\r\n0\r\n\r\n", b'{"new_timeline_id": "x"}', b"[[[[", b"\x00", b"\n",
]


@settings(max_examples=100, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_REQUEST_PIECES), max_size=14),
    tail=st.binary(max_size=40),
)
def test_hostile_requests_end_the_connection_cleanly(pieces: list[bytes], tail: bytes) -> None:
    """Whatever arrives, ``serve_connection`` answers (or not) and returns: no exception
    escapes it (one would take down the whole HTTP server), and it never hangs."""
    router, _ = make_router()
    server = HttpServer(router, HttpServerConfig(idle_timeout_s=0.2, max_body_bytes=1000))

    async def main() -> None:
        client, server_side = trio.testing.memory_stream_pair()

        async def talk() -> None:
            try:
                await client.send_all(b"".join(pieces) + tail)
                await client.send_eof()  # an incomplete request then ends at EOF, not the timeout
                while await client.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(talk)
                await server.serve_connection(server_side)
                await client.aclose()

    trio.run(main)
