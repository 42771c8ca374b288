"""Starting a primary endpoint needs a quorum of safekeepers to say where committed WAL ends.

No PostgreSQL here: the safekeepers are tiny HTTP servers answering the timeline status route
(or nothing listening at all), so the rule is checked on its own.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.ports import free_port
from control_plane.endpoint import EndpointError, _safekeeper_flush
from protocol.lsn import Lsn

T = "ab" * 16
TL = "cd" * 16


class _FakeEnv:
    """What ``_safekeeper_flush`` reads of a ``LocalEnv``."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    @property
    def safekeeper_ids(self) -> list[int]:
        return list(range(1, len(self.ports) + 1))

    def safekeeper_http(self, sk_id: int) -> str:
        return f"http://127.0.0.1:{self.ports[sk_id - 1]}"


@contextmanager
def _safekeeper(flush_lsn: str | None) -> Iterator[int]:
    """An HTTP server answering the timeline route with ``flush_lsn`` (None: 404)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if flush_lsn is None:
                body, status = {"msg": "timeline not found"}, 404
            else:
                body, status = {"flush_lsn": flush_lsn}, 200
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass  # keep pytest's output clean

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_no_safekeeper_reachable_refuses_to_guess() -> None:
    env = _FakeEnv([free_port(), free_port(), free_port()])
    with pytest.raises(EndpointError, match="only 0 of 3 safekeepers answered"):
        _safekeeper_flush(env, T, TL)  # type: ignore[arg-type]


def test_one_of_three_is_not_a_quorum() -> None:
    with _safekeeper("0/5000000") as port:
        env = _FakeEnv([port, free_port(), free_port()])
        with pytest.raises(EndpointError, match="only 1 of 3"):
            _safekeeper_flush(env, T, TL)  # type: ignore[arg-type]


def test_a_quorum_gives_its_highest_flush() -> None:
    with _safekeeper("0/5000000") as a, _safekeeper("0/7000000") as b:
        env = _FakeEnv([a, free_port(), b])
        assert _safekeeper_flush(env, T, TL) == Lsn(0x7000000)  # type: ignore[arg-type]


def test_safekeepers_without_the_timeline_count_as_answers() -> None:
    with _safekeeper(None) as a, _safekeeper(None) as b:
        env = _FakeEnv([a, b, free_port()])
        assert _safekeeper_flush(env, T, TL) is None  # type: ignore[arg-type]
