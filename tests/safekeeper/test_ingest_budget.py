"""The ingest byte budget never deadlocks: a message larger than the whole budget, a budget
of one byte, a queue of one message, with coalescing on and off, fsync on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from safekeeper.config import SafekeeperConfig
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, synthetic_wal
from tests.safekeeper.test_node_inprocess import TENANT, TIMELINE


@pytest.mark.parametrize(
    ("max_write_bytes", "no_sync"), [(0, True), (0, False), (1 << 20, True), (1 << 20, False)]
)
async def test_tiny_budget_and_queue_still_flow(
    tmp_path: Path, max_write_bytes: int, no_sync: bool
) -> None:
    cfg = SafekeeperConfig(
        data_dir=str(tmp_path / "sk"),
        listen_pg="127.0.0.1:0",
        listen_http="127.0.0.1:0",
        no_sync=no_sync,
        ingest_queue=1,
        ingest_queue_bytes=1,
        max_write_bytes=max_write_bytes,
    )
    sk = SafekeeperNode(cfg)
    start = Lsn(WAL_SEGMENT_SIZE)
    # Crosses a segment end too (the .partial rename between groups).
    wal = synthetic_wal(start, WAL_SEGMENT_SIZE + 300_000, record_size=8000)
    chunks = [wal[i : i + 131072] for i in range(0, len(wal), 131072)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(sk.run)
            assert sk.pg_port is not None
            async with await TestProposer.connect(
                "127.0.0.1", sk.pg_port, TENANT, TIMELINE
            ) as p:
                await p.greet()
                await p.elect(start)
                end = await p.append_many(start, chunks)
                resp = await p.wait_flush(Lsn(end - 8192))
                assert resp.flush_lsn > end - 8192
            sk.stop()
