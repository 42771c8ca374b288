"""Basebackups and branches at LSNs GC may have removed: refused with a clear error (libpq
ErrorResponse 22023; HTTP 400), never served from what is left. A child timeline below its
branch point reads its ancestor, so the ancestor's GC cutoff is the limit there (the branch
point itself is kept for the child)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from common.http import HttpError, Request
from pageserver.basebackup import BackupCommandHandler, gc_refusal, hold_lsn
from pageserver.config import PageserverConfig
from pageserver.http_api import build_router
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import Image, TestRecord
from pageserver.tenant import Tenant
from pageserver.tenant_manager import TenantManager
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn
from protocol.pgwire.errors import PgError
from tests.pageserver.test_timeline_branch import CFG


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


async def _write(tl: Timeline, lsn: int, key: Key, value: Image | TestRecord) -> None:
    await tl.put(key, Lsn(lsn), value)
    tl.finish_write(Lsn(lsn))


async def _tenant(root: Path) -> tuple[Tenant, Timeline, Timeline]:
    """main: k0/k1 written at 16..32, branched at 32 (child), then rewritten up to 64."""
    tenant = Tenant(root, TenantId.generate(), CFG)
    main = await tenant.create_timeline(TimelineId.generate())
    await _write(main, 16, k(0), Image(b"a"))
    await _write(main, 24, k(1), Image(b"b"))
    await _write(main, 32, k(0), TestRecord.wal_append(",32"))
    await main.flush()
    child = await tenant.create_timeline(TimelineId.generate(), ancestor=main, ancestor_lsn=Lsn(32))
    await _write(main, 40, k(0), Image(b"new"))
    await _write(main, 48, k(1), TestRecord.wal_append(",48"))
    await main.flush()
    await main.compact(force_image=True)
    await _write(main, 64, k(0), TestRecord.wal_append(",64"))
    await main.flush()
    await main.compact(force_image=True)
    return tenant, main, child


async def _gc_main(tenant: Tenant, main: Timeline) -> list[str]:
    """GC of the ancestor only: the child's own cutoff stays below its branch point, as it
    does for a young branch under a real gc_horizon (its disk_consistent_lsn bounds it)."""
    return await main.gc(lambda: tenant.children_branch_points(main))


class _Conn:
    """Just enough of a connection: a refused basebackup must not start its COPY."""

    def __init__(self) -> None:
        self.copies = 0

    def bind_log(self, **_: Any) -> None:
        pass

    async def enter_copy_out(self, **_: Any) -> Any:
        self.copies += 1
        raise _Started


class _Started(Exception):
    pass


async def _basebackup(tenant: Tenant, tl: Timeline, lsn: int) -> _Conn:
    handler = BackupCommandHandler(lambda _t, tid: tenant.timelines[tid])
    conn = _Conn()
    args = (tenant.tenant_id.hex, tl.timeline_id.hex, format_lsn(Lsn(lsn)))
    try:
        await handler.basebackup(conn, args)  # type: ignore[arg-type]
    except _Started:
        pass
    return conn


async def test_basebackup_below_gc_cutoffs_is_refused(tmp_path: Path) -> None:
    tenant, main, child = await _tenant(tmp_path)
    try:
        # before GC, the child below its branch point reads the ancestor: served
        assert gc_refusal(child, Lsn(24)) is None
        assert (await _basebackup(tenant, child, 24)).copies == 1
        assert await _gc_main(tenant, main), "GC removed nothing: the test does not exercise it"
        assert main.latest_gc_cutoff_lsn == 64 and child.latest_gc_cutoff_lsn == 0
        for tl, lsn, why in [(child, 24, "below the branch point 0/20"), (main, 48, "below the GC cutoff 0/40")]:
            conn = _Conn()
            with pytest.raises(PgError) as info:
                conn = await _basebackup(tenant, tl, lsn)
            assert info.value.sqlstate == "22023", info.value.sqlstate
            assert why in info.value.message, info.value.message
            assert conn.copies == 0
        # the branch point itself is kept for the child, and the child's own LSNs
        assert (await _basebackup(tenant, child, 32)).copies == 1
        assert await child.get(k(0), Lsn(32)) == b"a,32"
        assert (await _basebackup(tenant, main, 64)).copies == 1
    finally:
        await tenant.shutdown()


async def test_hold_lsn_keeps_the_ancestors_gc_below_it(tmp_path: Path) -> None:
    tenant, main, child = await _tenant(tmp_path)
    try:
        with hold_lsn(child, Lsn(24)):
            await _gc_main(tenant, main)
            assert main.latest_gc_cutoff_lsn <= 24
            assert gc_refusal(child, Lsn(24)) is None
            assert await child.get_vectored([k(0), k(1)], Lsn(24)) == {k(0): b"a", k(1): b"b"}
        await _gc_main(tenant, main)
        assert main.latest_gc_cutoff_lsn == 64
        assert gc_refusal(child, Lsn(24)) is not None
    finally:
        await tenant.shutdown()


async def test_branch_below_the_source_timelines_branch_point_is_refused(tmp_path: Path) -> None:
    manager = TenantManager(PageserverConfig(workdir=tmp_path))
    tenant, _main, child = await _tenant(tmp_path / "t")
    manager.tenants[tenant.tenant_id] = tenant
    try:
        router = build_router(manager, CollectorRegistry())
        path = f"/v1/tenant/{tenant.tenant_id.hex}/timeline"
        handler, params = router.resolve("POST", path)
        body = {"ancestor_timeline_id": child.timeline_id.hex, "ancestor_start_lsn": "0/18"}
        req = Request("POST", path, {}, {}, json.dumps(body).encode(), params)
        with pytest.raises(HttpError) as info:
            await handler(req)
        assert info.value.status == 400
        assert "below the branch point 0/20" in info.value.msg, info.value.msg
        assert list(tenant.timelines) == [_main.timeline_id, child.timeline_id]
    finally:
        await tenant.shutdown()
