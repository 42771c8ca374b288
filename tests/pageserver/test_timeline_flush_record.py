"""A flush from outside the writer (the tenant's background ``flush_if_old``, the HTTP
checkpoint, shutdown) must never freeze part of a record: the layer would end at that record's
LSN, ``disk_consistent_lsn`` would claim it, the writer's next value of the same record would
be refused (below the new layer's start), and after a restart the record would be skipped
with values missing. The public ``freeze`` refuses the same (``PartialRecordError``); the
writer's own roll, between two records, still freezes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from pageserver.storage.config import StorageConfig
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import LsnTimeoutError, PartialRecordError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

CFG = StorageConfig(validate_get=True, double_buffering=False, gc_horizon=0, pitr_interval_s=0)


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


async def test_flush_waits_for_the_record_being_put(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tid = TimelineId.generate()
    tl = await tenant.create_timeline(tid)
    await tl.put(k(0), Lsn(0x10), Image(b"a"))
    tl.finish_write(Lsn(0x10))
    await tl.put(k(1), Lsn(0x20), Image(b"b1"))  # record 0x20: first of two values
    flushed = trio.Event()

    async def background_flush() -> None:
        await tl.flush()
        flushed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(background_flush)
        await trio.testing.wait_all_tasks_blocked()
        assert not flushed.is_set(), "flushed part of record 0x20"
        await tl.put(k(2), Lsn(0x20), Image(b"b2"))  # the writer goes on with the record
        tl.finish_write(Lsn(0x20))
    assert tl.disk_consistent_lsn == 0x20
    assert await tl.get_vectored([k(0), k(1), k(2)], Lsn(0x20)) == {
        k(0): b"a",
        k(1): b"b1",
        k(2): b"b2",
    }
    await tenant.shutdown()
    # After a restart the record is whole on disk.
    again = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    tl2 = again.timelines[tid]
    assert tl2.last_record_lsn == 0x20
    assert await tl2.get_vectored([k(1), k(2)], Lsn(0x20)) == {k(1): b"b1", k(2): b"b2"}
    await again.shutdown()


async def test_flush_of_an_abandoned_record_fails_instead_of_claiming_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # The writer failed (or was cancelled) mid-record: flushing would make the partial record
    # durable and later skipped, so the flush fails (after wait_lsn_timeout_s) and
    # disk_consistent_lsn stays below the record: a restart re-ingests it whole.
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    await tl.put(k(0), Lsn(0x10), Image(b"a"))
    tl.finish_write(Lsn(0x10))
    await tl.put(k(1), Lsn(0x20), Image(b"b1"))
    before = tl.disk_consistent_lsn
    with pytest.raises(LsnTimeoutError, match="0/20 is only partly put"):
        await tl.flush()
    assert tl.disk_consistent_lsn == before
    await tenant.shutdown()



async def test_flush_if_old_skips_a_partly_put_record(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # The background job must not sit on the layers lock waiting for (or failing on) a record
    # in progress: it leaves the layer for the next period.
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    await tl.put(k(0), Lsn(0x10), Image(b"a"))
    tl.finish_write(Lsn(0x10))
    await tl.put(k(1), Lsn(0x20), Image(b"b1"))
    assert tl.open_layer is not None
    tl.open_layer.opened_at -= 3600
    start = trio.current_time()
    await tl.flush_if_old()
    assert trio.current_time() == start and tl.disk_consistent_lsn == 0
    tl.finish_write(Lsn(0x20))
    await tl.flush_if_old()
    assert tl.disk_consistent_lsn == 0x20
    await tenant.shutdown()


async def test_freeze_inside_a_record_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tid = TimelineId.generate()
    tl = await tenant.create_timeline(tid)
    await tl.put(k(0), Lsn(0x10), Image(b"a"))
    tl.finish_write(Lsn(0x10))
    await tl.put(k(1), Lsn(0x20), Image(b"b1"))  # record 0x20: first of two values
    layer = tl.open_layer
    with pytest.raises(PartialRecordError, match="0/20 is only partly put"):
        await tl.freeze()
    assert tl.open_layer is layer and not tl.frozen_layers
    # the writer finishes the record: nothing of it was refused
    await tl.put(k(2), Lsn(0x20), Image(b"b2"))
    tl.finish_write(Lsn(0x20))
    await tl.freeze()  # now at the record boundary
    assert tl.open_layer is None and [x.end_lsn for x in tl.frozen_layers] == [0x21]
    await tl.flush()
    assert tl.disk_consistent_lsn == 0x20
    await tenant.shutdown()
    again = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    tl2 = again.timelines[tid]
    assert await tl2.get_vectored([k(0), k(1), k(2)], Lsn(0x20)) == {
        k(0): b"a",
        k(1): b"b1",
        k(2): b"b2",
    }
    await again.shutdown()


async def test_the_writers_roll_still_freezes_between_records(tmp_path: Path) -> None:
    # put_encoded rolls when the next record's put would overflow the layer: the records put
    # so far are whole even though the writer has not called finish_write for the last one
    cfg = StorageConfig(validate_get=True, double_buffering=False, gc_horizon=0, pitr_interval_s=0,
                        checkpoint_distance=64 * 1024)
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    tl = await tenant.create_timeline(TimelineId.generate())
    big = b"x" * 40_000
    await tl.put(k(0), Lsn(0x10), Image(big))
    await tl.put(k(1), Lsn(0x10), Image(big[:10]))
    await tl.put(k(2), Lsn(0x20), Image(big))  # rolls: the layer [.., 0x11) holds record 0x10
    assert tl.disk_consistent_lsn == 0x10
    tl.finish_write(Lsn(0x20))
    assert await tl.get_vectored([k(0), k(1), k(2)], Lsn(0x20)) == {
        k(0): big,
        k(1): big[:10],
        k(2): big,
    }
    await tenant.shutdown()
