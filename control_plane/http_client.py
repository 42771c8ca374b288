"""A small synchronous JSON client for the nodes' HTTP management APIs (urllib, no extras).

``ApiError`` carries the status and the server's ``{"msg": ...}``; a refused connection stays
an ``OSError`` (``URLError``) so callers can tell "node down" from "node said no".

Credentials are per node: ``register_credentials(base_url, token, ssl_context)`` (the cluster
directory does it for its nodes when it is loaded) makes every request to that base URL carry
``Authorization: Bearer <token>`` and verify the server's certificate with the context.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

# base URL ("https://127.0.0.1:9898") -> (token, TLS context)
_credentials: dict[str, tuple[str | None, ssl.SSLContext | None]] = {}


def register_credentials(base_url: str, token: str | None, ssl_context: ssl.SSLContext | None) -> None:
    _credentials[base_url.rstrip("/")] = (token, ssl_context)


def _credentials_for(url: str) -> tuple[str | None, ssl.SSLContext | None]:
    for base, creds in _credentials.items():
        if url == base or url.startswith(base + "/"):
            return creds
    return None, None


class ApiError(Exception):
    def __init__(self, method: str, url: str, status: int, msg: str) -> None:
        super().__init__(f"{method} {url}: HTTP {status}: {msg}")
        self.status = status
        self.msg = msg


def request_json(method: str, url: str, body: object | None = None, *, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    token, ctx = _credentials_for(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            msg = str(json.loads(raw).get("msg", raw.decode(errors="replace")))
        except (ValueError, AttributeError):
            msg = raw.decode(errors="replace")
        raise ApiError(method, url, exc.code, msg) from None
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError(method, url, 200, f"answer is not JSON: {raw[:200]!r}") from None


def get_json(url: str, *, timeout: float = 60.0) -> Any:
    return request_json("GET", url, timeout=timeout)


def post_json(url: str, body: object, *, timeout: float = 300.0) -> Any:
    return request_json("POST", url, body, timeout=timeout)
