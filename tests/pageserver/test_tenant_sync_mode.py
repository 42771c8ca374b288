"""The ``io_sync_mode`` knob reaches the tenant's IO engine, and each mode stores real data."""

from __future__ import annotations

from pathlib import Path

import pytest

from pageserver.storage.config import StorageConfig
from pageserver.storage.key import rel_block_key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn


@pytest.mark.parametrize("mode", ["none", "dsync", "direct"])
async def test_sync_mode_reaches_engine_and_data_survives_reload(tmp_path: Path, mode: str) -> None:
    cfg = StorageConfig(validate_get=True, double_buffering=False, io_sync_mode=mode)  # type: ignore[arg-type]
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    tenant = Tenant(tmp_path, tenant_id, cfg)
    assert tenant.engine.write_sync_mode == mode
    tl = await tenant.create_timeline(timeline_id)
    pages = {rel_block_key(1663, 5, 1000, 0, i): bytes([i]) * 8192 for i in range(8)}
    for i, (key, page) in enumerate(pages.items(), start=1):
        await tl.put(key, Lsn(16 * i), Image(page))
        tl.finish_write(Lsn(16 * i))
    await tl.flush()
    last = tl.last_record_lsn
    await tenant.shutdown()

    again = await Tenant.load(tmp_path, tenant_id, cfg)
    try:
        assert again.engine.write_sync_mode == mode
        got = await again.timelines[timeline_id].get_vectored(list(pages), last)
        assert got == pages
    finally:
        await again.shutdown()


def test_unknown_sync_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="io_sync_mode"):
        StorageConfig(io_sync_mode="fsync-please")  # type: ignore[arg-type]
