"""The benchmark floor (``pageserver.page_service.null_server``) and its rows in
``pagestore bench getpage --floor``.

The floor is only worth printing if it does the work a page service must do on the wire: parse
the framing, answer every GetPage in order with its request echoed and an 8 KiB page, and
refuse what it does not serve. These tests check that with the same clients the benchmark uses
(and the client's own v3 echo check), then that one small benchmark run prints the rows.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.getpage import _emit
from compute.page_client import BlockingPageClient, PageClient
from pageserver.page_service import null_server
from pageserver.page_service.null_server import NullPagestream, NullStreamEnd, null_page
from protocol.ids import TenantId, TimelineId
from protocol.lsn import MAX_LSN, Lsn
from protocol.pagestream import (
    ExistsRequest,
    GetPageRequest,
    GetPageResponse,
    RelTag,
    decode_response,
    encode_request_into,
)
from protocol.pgwire import NEED_DATA, BackendDecoder
from protocol.pgwire import messages as m
from protocol.pgwire.errors import PgError

REPO = Path(__file__).resolve().parents[2]
TENANT, TIMELINE = TenantId.generate(), TimelineId.generate()


def _requests(n: int, first: int = 1) -> list[GetPageRequest]:
    return [
        GetPageRequest(first + i, MAX_LSN, Lsn(i), RelTag(1663, 5, 16384 + i % 3, i % 2), i * 7)
        for i in range(n)
    ]


def _check_answers(responses: Sequence[object], requests: list[GetPageRequest]) -> None:
    assert len(responses) == len(requests)
    for response, request in zip(responses, requests, strict=True):
        assert isinstance(response, GetPageResponse)
        assert response.request == request
        assert bytes(response.page) == null_page()


def _handshake() -> bytes:
    query = f"pagestream_v3 {TENANT.hex} {TIMELINE.hex}"
    return m.encode(m.StartupMessage({"user": "u", "database": "u"}), m.Query(query))


def _backend_messages(data: bytes) -> list[object]:
    decoder = BackendDecoder()
    decoder.receive_data(data)
    out: list[object] = []
    while (msg := decoder.next_event()) is not NEED_DATA:
        out.append(msg)
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), cuts=st.lists(st.integers(1, 400), max_size=30))
def test_null_stream_answers_every_getpage_in_order_for_any_segmentation(
    n: int, cuts: list[int]
) -> None:
    requests = _requests(n, first=100)
    wire = bytearray(_handshake())
    for request in requests:
        encode_request_into(wire, request, 3, framed=True)
    stream = NullPagestream()
    out = bytearray()
    pos = 0
    for cut in [*cuts, len(wire)]:
        out += stream.receive(bytes(wire[pos : pos + cut]))
        pos += cut
        if pos >= len(wire):
            break
    messages = _backend_messages(bytes(out))
    assert isinstance(messages[0], m.AuthenticationOk)
    assert isinstance(messages[1], m.ReadyForQuery)
    assert isinstance(messages[2], m.CopyBothResponse)
    copies = messages[3:]
    assert all(isinstance(c, m.CopyData) for c in copies)
    # ``decode_response`` with the request raises unless the v3 echo matches it.
    responses = [
        decode_response(c.data, 3, r)  # type: ignore[attr-defined]
        for c, r in zip(copies, requests, strict=True)
    ]
    _check_answers(responses, requests)


def _stream_after_handshake() -> NullPagestream:
    stream = NullPagestream()
    stream.receive(_handshake())
    return stream


def test_null_stream_refuses_what_it_does_not_serve() -> None:
    exists = bytearray()
    encode_request_into(exists, ExistsRequest(1, MAX_LSN, Lsn(0), RelTag(1, 2, 3, 0)), 3, framed=True)
    v2 = bytearray()
    encode_request_into(v2, GetPageRequest(0, MAX_LSN, Lsn(0), RelTag(1, 2, 3, 0), 1), 2, framed=True)
    for bad in (bytes(exists), bytes(v2), b"Q\x00\x00\x00\x05\x00"):
        with pytest.raises(NullStreamEnd) as caught:
            _stream_after_handshake().receive(bad)
        (error,) = _backend_messages(caught.value.reply)
        assert isinstance(error, m.ErrorResponse)
        assert error.fields[0] == ("S", "FATAL")
    # Requests before the end are still answered, in order: a clean end (CopyDone) sends
    # only them, a refused request sends them and then the FATAL error.
    good = bytearray()
    encode_request_into(good, _requests(1)[0], 3, framed=True)
    with pytest.raises(NullStreamEnd) as caught:
        _stream_after_handshake().receive(bytes(good) + m.encode(m.CopyDone()))
    (copy,) = _backend_messages(caught.value.reply)
    assert isinstance(copy, m.CopyData)
    with pytest.raises(NullStreamEnd) as caught:
        _stream_after_handshake().receive(bytes(good) + bytes(exists))
    copy, error = _backend_messages(caught.value.reply)
    assert isinstance(copy, m.CopyData) and isinstance(error, m.ErrorResponse)
    # Only pagestream_v3 opens a stream.
    stream = NullPagestream()
    with pytest.raises(NullStreamEnd) as caught:
        stream.receive(
            m.encode(m.StartupMessage({"user": "u"}), m.Query(f"pagestream_v2 {TENANT.hex} x"))
        )
    assert any(isinstance(msg, m.ErrorResponse) for msg in _backend_messages(caught.value.reply))


def test_null_blocking_server_answers_a_blocking_client() -> None:
    sock = null_server.listen()
    stop = threading.Event()
    thread = threading.Thread(target=null_server.serve_blocking, args=(sock,), kwargs={"stop": stop})
    thread.start()
    try:
        port = sock.getsockname()[1]
        with BlockingPageClient.connect("127.0.0.1", port, TENANT, TIMELINE) as client:
            requests = [
                GetPageRequest(client.next_reqid(), MAX_LSN, Lsn(0), RelTag(1, 2, 3, 0), blk)
                for blk in range(40)
            ]
            client.send(*requests)
            _check_answers([client.receive() for _ in requests], requests)
            assert client.get_page(RelTag(1, 2, 3, 0), 9) == null_page()
        with pytest.raises(PgError):
            BlockingPageClient.connect("127.0.0.1", port, TENANT, TIMELINE, version=2)
    finally:
        stop.set()
        thread.join(5)
        sock.close()
    assert not thread.is_alive()


async def test_null_trio_server_answers_pipelined_clients() -> None:
    sock = null_server.listen()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(null_server.serve_trio, sock)

        async def one(first: int) -> None:
            client = await PageClient.connect("127.0.0.1", port, TENANT, TIMELINE)
            async with client:
                requests = _requests(70, first=first)
                _check_answers(await client.pipelined(requests, queue_depth=16), requests)

        async with trio.open_nursery() as clients:
            for i in range(3):
                clients.start_soon(one, 1 + 1000 * i)
        nursery.cancel_scope.cancel()
    sock.close()


def test_emit_adds_the_ratio_to_postgres(capsys: pytest.CaptureFixture[str]) -> None:
    rows: dict[tuple[object, ...], list[dict[str, object]]] = {}
    _emit((rows, 1, 4000.0), {"pages_per_s": 9000}, ("k",))
    _emit((rows, 1, None), {"pages_per_s": 9000}, ("k",))
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert isinstance(first.pop("load_1m"), float)  # the machine's load beside every row
    assert first == {"pages_per_s": 9000, "round": 1, "vs_postgres": 2.25}
    assert "vs_postgres" not in second
    assert len(rows[("k",)]) == 2


def test_bench_prints_floor_rows_beside_the_real_server() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "control_plane.cli",
            "bench",
            "getpage",
            "--duration",
            "0.3",
            "--pages",
            "64",
            "--clients",
            "1",
            "--modes",
            "serial",
            "--queue-depth",
            "4",
            "--floor",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_target = {r["target"]: r for r in rows if "target" in r}
    assert set(by_target) == {"pagestore", "null-trio", "null-blocking"}
    for target in ("null-trio", "null-blocking"):
        row = by_target[target]
        assert row["floor"] is True
        assert row["queue_depth"] == 4 and row["clients_per_tenant"] == 1
        assert row["request_count"] > 0 and row["pages_per_s"] > 0
        assert row["latency_p50_us"] > 0 and row["latency_mean_us"] > 0
        assert row["server_cpu_us_per_request"] is not None
    assert by_target["pagestore"]["mode"] == "serial"


def test_listen_binds_loopback_only() -> None:
    sock = null_server.listen()
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
        assert sock.type == socket.SOCK_STREAM
    finally:
        sock.close()
