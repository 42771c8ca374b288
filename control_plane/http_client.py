"""A small synchronous JSON client for the nodes' HTTP management APIs (urllib, no extras).

``ApiError`` carries the status and the server's ``{"msg": ...}``; a refused connection stays
an ``OSError`` (``URLError``) so callers can tell "node down" from "node said no".
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


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
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
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
