"""Horizon sharing between the safekeepers of a cluster (what Neon's broker does), by polling.

The pageserver reports ``remote_consistent_lsn`` only to the safekeeper it streams from, so
the other ones would keep their WAL for ever (and a pageserver recreated from scratch would
find the old WAL there instead of having to read it back from the backup, or worse, would find
it on one node and not the other). So every ``period_s`` each safekeeper asks every peer of
``peer_http`` (``GET /v1/timelines`` on its HTTP port, with the node's token when auth is on)
and raises each of its own timelines' ``remote_consistent_lsn`` to the highest a peer reports
(it only grows; like a pageserver's feedback it then bounds WAL removal). Nothing else is
taken from peers: ``backup_lsn`` is learnt from the store itself (``safekeeper.wal_backup``).
A peer that does not answer is logged at debug level and asked again next period.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
import trio

from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, parse_lsn

if TYPE_CHECKING:
    from safekeeper.timeline import Timeline

log = structlog.get_logger("safekeeper.peers")

TIMEOUT_S = 5.0


def _get_json(url: str, token: str | None, context: ssl.SSLContext | None) -> Any:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=context) as resp:
        return json.loads(resp.read())


def peer_horizons(doc: object) -> dict[tuple[TenantId, TimelineId], Lsn]:
    """``remote_consistent_lsn`` per timeline from a peer's ``/v1/timelines`` answer; entries
    that do not parse are skipped (a peer of another version, or garbage)."""
    out: dict[tuple[TenantId, TimelineId], Lsn] = {}
    if not isinstance(doc, list):
        return out
    for tl in doc:
        if not isinstance(tl, dict):
            continue
        fields = tl.get("tenant_id"), tl.get("timeline_id"), tl.get("remote_consistent_lsn")
        if not all(isinstance(f, str) for f in fields):
            continue
        tenant, timeline, lsn_text = fields
        assert isinstance(tenant, str) and isinstance(timeline, str) and isinstance(lsn_text, str)
        try:
            key = (TenantId.parse(tenant), TimelineId.parse(timeline))
            lsn = parse_lsn(lsn_text)
        except (ValueError, RemoteProtocolError):
            continue
        out[key] = Lsn(max(out.get(key, 0), lsn))
    return out


async def run_peer_sync(
    timelines: dict[tuple[TenantId, TimelineId], Timeline],
    peers: Sequence[str],
    period_s: float,
    *,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
) -> None:
    """Every ``period_s``: take the peers' ``remote_consistent_lsn`` (runs until cancelled)."""
    while True:
        for base in peers:
            url = base.rstrip("/") + "/v1/timelines"
            try:
                doc = await trio.to_thread.run_sync(_get_json, url, token, context)
            except (OSError, ValueError) as exc:
                log.debug("peer safekeeper did not answer", peer=base, error=str(exc))
                continue
            for key, lsn in peer_horizons(doc).items():
                tl = timelines.get(key)
                if tl is not None:
                    tl.acceptor.pageserver_progress(lsn)
        await trio.sleep(period_s)
