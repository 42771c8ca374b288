"""The pageserver's upcalls to the storage controller (``control_plane_api`` in its config):
``re_attach`` at start-up (which tenants are mine, in which generation), ``attach`` for a
tenant it creates, ``validate`` before it deletes remote objects or reports
``remote_consistent_lsn`` (remote-storage.md §3).

HTTP(S)/JSON through urllib in a worker thread; with auth on, every call carries the node's
``generations_api`` token as ``Authorization: Bearer`` (from ``$PAGESTORE_CONTROL_PLANE_API_TOKEN``,
never a command-line argument), and with TLS the controller's certificate is verified against
the cluster's CA (``ssl_ca_file``). A refused token (401/403) is not retried: the message says
why. ``re_attach`` and ``attach`` retry until the
controller answers (the node cannot serve a tenant without a generation); ``validate`` tries a
few times and then answers "not valid": the deletion is dropped (a leak) or the LSN stays (the
safekeepers keep WAL) — both safe while the controller is away.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import structlog
import trio

from protocol.ids import TenantId
from remote_storage.errors import RemoteStorageError
from remote_storage.retry import retry

log = structlog.get_logger("pageserver.control_plane_client")


class ControlPlaneError(RemoteStorageError):
    """The controller could not be reached or answered with an error status."""


class ControlPlaneRefusedError(ControlPlaneError):
    retryable = False


class ControlPlaneClient:
    def __init__(
        self,
        base_url: str,
        node_id: int,
        *,
        timeout_s: float = 10.0,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/") + "/"
        self.node_id = node_id
        self.timeout_s = timeout_s
        self._headers = {"content-type": "application/json"}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        self.ssl_context = ssl_context

    def _post_sync(self, path: str, body: object) -> Any:
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), method="POST", headers=self._headers,
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.ssl_context) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            cls = ControlPlaneRefusedError if 400 <= err.code < 500 else ControlPlaneError
            raise cls(f"{path}: HTTP {err.code} {text}") from None
        except (OSError, ValueError) as exc:
            raise ControlPlaneError(f"{path}: {exc}") from exc

    async def _post(self, path: str, body: object) -> Any:
        return await trio.to_thread.run_sync(self._post_sync, path, body)

    async def re_attach(self) -> dict[TenantId, int]:
        doc = await retry(lambda: self._post("re-attach", {"node_id": self.node_id}), what="re-attach")
        return {TenantId.parse(t["id"]): int(t["gen"]) for t in doc["tenants"]}

    async def attach(self, tenant_id: TenantId) -> int:
        doc = await retry(
            lambda: self._post("attach", {"tenant_id": tenant_id.hex, "node_id": self.node_id}),
            what="attach",
        )
        return int(doc["gen"])

    async def validate(self, tenant_id: TenantId, generation: int) -> bool:
        try:
            doc = await retry(
                lambda: self._post("validate", {"tenants": [{"id": tenant_id.hex, "gen": generation}]}),
                what="validate", attempts=3,
            )
        except ControlPlaneError as exc:
            log.warning("generation not validated (controller unavailable)", tenant_id=tenant_id.hex,
                        generation=generation, error=str(exc))
            return False
        return any(t["id"] == tenant_id.hex and t["valid"] for t in doc["tenants"])
