"""The WAL receiver reads from remote storage the WAL no safekeeper holds any more: a real
safekeeper backs its closed segments up and trims them, and a receiver starting at the
beginning gets every record, in order, once: the trimmed ones from the store (SeaweedFS), the rest from the safekeeper, with the record cut by the last backed-up segment's
end continued across the switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from pageserver.wal_receiver import RemoteWal, WalReceiver, WalReceiverConfig
from protocol.lsn import WAL_SEGMENT_SIZE
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from remote_storage import RemoteStorageConfig
from remote_storage.wal_layout import wal_segment_key
from safekeeper.testing import running_node
from tests.safekeeper.test_node_inprocess import TENANT, TIMELINE
from tests.safekeeper.test_wal_backup import START, local_segments, wait_for, write_wal

SEG = WAL_SEGMENT_SIZE


@pytest.fixture
def store_config(s3_config: RemoteStorageConfig) -> RemoteStorageConfig:
    # SeaweedFS only: the local kind is read back in tests/integration/test_wal_backup_cluster.py
    # (the same receiver, in a pageserver).
    return s3_config


def records_of(wal: bytes) -> list[tuple[int, int]]:
    dec = WalStreamDecoder(START)
    dec.feed(wal)
    out: list[DecodedRecord] = []
    dec.decode_into(out)
    return [(r.lsn, r.end_lsn) for r in out]


async def test_receiver_reads_trimmed_wal_from_the_backup(
    tmp_path: Path, store_config: RemoteStorageConfig
) -> None:
    async with running_node(tmp_path / "sk", remote_storage=store_config,
                            wal_removal_period_s=0.05, wal_backup_period_s=0.05) as sk:
        wal, end = await write_wal(sk.pg_port or 0, 2 * SEG + SEG // 2)
        expected = records_of(wal)
        assert expected[-1][1] == end
        # A record crosses the end of the last backed-up segment (the switch back is mid-record).
        assert any(lsn < 3 * SEG < rec_end for lsn, rec_end in expected)
        tl = sk.timelines[(TENANT, TIMELINE)]
        await wait_for("backup", lambda: tl.acceptor.backup_lsn == 3 * SEG)
        tl.acceptor.pageserver_progress(end)
        await wait_for("removal", lambda: local_segments(sk) == [3])
        assert sk.remote is not None
        cfg = WalReceiverConfig(safekeepers=(("127.0.0.1", sk.pg_port or 0),), tenant_id=TENANT,
                                timeline_id=TIMELINE, application_name="pageserver-test",
                                min_backoff_s=0.02, max_backoff_s=0.2)

        # Without the store, nothing can be had: the safekeeper answers 58P01.
        got: list[tuple[int, int]] = []

        async def collect(batch: list[DecodedRecord]) -> None:
            got.extend((r.lsn, r.end_lsn) for r in batch)

        alone = WalReceiver(cfg, start_lsn=START, on_records=collect)
        with trio.move_on_after(1.0):
            await alone.run()
        assert got == [] and "already been removed" in str(alone.last_error)

        # A damaged object (cut short) is refused, nothing of it handed over.
        key = wal_segment_key(TENANT, TIMELINE, 1)
        good = await sk.remote.download(key)
        await sk.remote.upload(key, good[: SEG // 2])
        damaged = WalReceiver(cfg, start_lsn=START, on_records=collect,
                              remote_wal=RemoteWal(sk.remote, TENANT, TIMELINE))
        with trio.move_on_after(1.0):
            await damaged.run()
        assert got == [] and f"has {SEG // 2} bytes, expected {SEG}" in str(damaged.last_error)
        await sk.remote.upload(key, good)

        receiver = WalReceiver(cfg, start_lsn=START, on_records=collect,
                               remote_wal=RemoteWal(sk.remote, TENANT, TIMELINE))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver.run)
            with trio.fail_after(60):
                await receiver.wait_for_lsn(end)
            nursery.cancel_scope.cancel()
        assert got == expected
        assert receiver.remote_segments == 2 and receiver.remote_sessions >= 1
