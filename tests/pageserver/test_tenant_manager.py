"""TenantManager and tenant loading: the node runs every tenant's background jobs (old open layers flushed,
compaction, GC), for created and for loaded tenants, and a failed round neither stops them nor
the node; at shutdown a timeline whose flush does not finish in time is reported, not silently
skipped, and the other timelines and tenants are still flushed and shut down. A crash in the
middle of an import leaves no half-imported timeline; layer files without an index_part are
never deleted by a guess."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from structlog.testing import capture_logs

from pageserver import tenant_manager as tm
from pageserver.config import PageserverConfig
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.layer_file import LayerCorruptionError
from pageserver.storage.value import Image
from pageserver.tenant import UNINIT_SUFFIX, Tenant
from pageserver.tenant_manager import TenantManager, TimelineNotFoundError
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

JOBS = StorageConfig(double_buffering=False, checkpoint_timeout_s=60, compaction_period_s=20,
                     gc_period_s=0)


def _key(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


async def _write_old(tl: Timeline, lsn: int) -> None:
    """One value at ``lsn``, in an open layer that has waited past checkpoint_timeout_s."""
    await tl.put(_key(lsn), Lsn(lsn), Image(b"v%d" % lsn))
    tl.finish_write(Lsn(lsn))
    # The open layer's age is time.monotonic, not trio's clock: backdate it.
    assert tl.open_layer is not None
    tl.open_layer.opened_at -= 3600


async def test_node_runs_background_jobs_for_created_and_loaded_tenants(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    conf = PageserverConfig(workdir=tmp_path, tenant_config=JOBS)
    async with trio.open_nursery() as nursery:
        manager = TenantManager(conf)
        await manager.start(nursery)
        tenant = await manager.create_tenant()
        tl = await tenant.create_timeline(TimelineId.generate())
        await _write_old(tl, 16)
        await trio.sleep(21)
        assert tl.disk_consistent_lsn == 16 and not tl.in_memory_layers()
        await manager.shutdown()
        # After a restart the loaded tenant gets its jobs too.
        manager = TenantManager(conf)
        await manager.start(nursery)
        tl = manager.get_timeline(tenant.tenant_id, tl.timeline_id)
        await _write_old(tl, 24)
        await trio.sleep(21)
        assert tl.disk_consistent_lsn == 24 and not tl.in_memory_layers()
        await manager.shutdown()
        nursery.cancel_scope.cancel()


async def test_a_failed_compaction_round_is_logged_and_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    conf = PageserverConfig(workdir=tmp_path, tenant_config=JOBS)
    async with trio.open_nursery() as nursery:
        manager = TenantManager(conf)
        await manager.start(nursery)
        tenant = await manager.create_tenant()
        tl = await tenant.create_timeline(TimelineId.generate())
        real_compact = tl.compact
        calls = 0

        async def failing_once(*, force_image: bool = False) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise OSError(28, "No space left on device")
            await real_compact(force_image=force_image)

        tl.compact = failing_once  # type: ignore[method-assign]
        with capture_logs() as logs:
            await trio.sleep(45)
        assert calls == 2  # the loop survived the failure and ran again
        failed = [e for e in logs if e["event"].startswith("compaction failed")]
        assert len(failed) == 1 and failed[0]["log_level"] == "error"
        assert failed[0]["timeline_id"] == tl.timeline_id.hex and failed[0]["exc_info"]
        assert tenant.background_failures == 1
        await manager.shutdown()
        nursery.cancel_scope.cancel()


class _FakeTimeline:
    def __init__(self, *, hangs: bool) -> None:
        self.timeline_id = TimelineId.generate()
        self.disk_consistent_lsn = Lsn(0x100)
        self.last_record_lsn = Lsn(0x200)
        self.hangs = hangs
        self.flushed = False

    async def flush(self) -> None:
        if self.hangs:
            await trio.sleep_forever()
        self.flushed = True


class _FakeTenant:
    def __init__(self, timelines: list[_FakeTimeline]) -> None:
        self.timelines = {tl.timeline_id: tl for tl in timelines}
        self.shut_down = False

    async def shutdown(self) -> None:
        self.shut_down = True


async def test_shutdown_reports_a_flush_that_timed_out(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    manager = TenantManager(PageserverConfig(workdir=tmp_path, shutdown_timeout_s=1.0))
    stuck, fine = _FakeTimeline(hangs=True), _FakeTimeline(hangs=False)
    tenant = _FakeTenant([stuck, fine])
    manager.tenants[TenantId.generate()] = tenant  # type: ignore[assignment]
    with capture_logs() as logs:
        with trio.fail_after(60):
            await manager.shutdown()
    timed_out = [e for e in logs if "timed out" in e["event"]]
    assert [e["timeline_id"] for e in timed_out] == [stuck.timeline_id.hex]
    assert timed_out[0]["log_level"] == "warning"
    assert timed_out[0]["disk_consistent_lsn"] == "0/100"
    assert fine.flushed and tenant.shut_down


# -- timelines filled after creation (bootstrap, import) ----------------------------------------


class _Crash(Exception):
    """Stands for the process dying in the middle of an import."""


async def test_a_crash_during_import_leaves_no_half_imported_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeline holds flushed layers and an index_part (as after a rolled flush in a big
    import) when the process dies: the restart must not serve it as if complete."""
    source = tmp_path / "pgdata"
    source.mkdir()
    conf = PageserverConfig(workdir=tmp_path / "ps", tenant_config=JOBS)

    async def partial_import(tl: Timeline, src: Path, *, wal_tar: Path | None = None) -> None:
        assert src == source
        assert tl.path.with_name(tl.timeline_id.hex + UNINIT_SUFFIX).exists()
        await tl.put(_key(1), Lsn(0x100), Image(b"half"))
        tl.finish_write(Lsn(0x100))
        await tl.flush()
        assert tl.disk_consistent_lsn == 0x100 and (tl.path / "index_part.json").exists()
        raise _Crash

    async def died(self: TenantManager, tenant: object, timeline_id: TimelineId) -> None:
        pass  # a dead process cleans nothing up

    monkeypatch.setattr(tm, "import_datadir", partial_import)
    monkeypatch.setattr(TenantManager, "_discard", died)
    manager = TenantManager(conf)
    tenant = await manager.create_tenant()
    tid = TimelineId.generate()
    with pytest.raises(_Crash):
        await manager.import_timeline(tenant.tenant_id, tid, source)
    assert (tenant.timelines_dir / tid.hex).is_dir()

    reloaded = await Tenant.load(tenant.path, tenant.tenant_id, JOBS)
    assert tid not in reloaded.timelines
    assert sorted(p.name for p in tenant.timelines_dir.iterdir()) == []
    await reloaded.shutdown()


async def test_a_finished_import_is_kept_and_its_marker_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "pgdata"
    source.mkdir()

    async def fake_import(tl: Timeline, src: Path, *, wal_tar: Path | None = None) -> None:
        await tl.put(_key(1), Lsn(0x100), Image(b"whole"))
        tl.finish_write(Lsn(0x100))

    monkeypatch.setattr(tm, "import_datadir", fake_import)
    manager = TenantManager(PageserverConfig(workdir=tmp_path / "ps", tenant_config=JOBS))
    tenant = await manager.create_tenant()
    tl = await manager.import_timeline(tenant.tenant_id, None, source)
    assert sorted(p.name for p in tenant.timelines_dir.iterdir()) == [tl.timeline_id.hex]
    await manager.shutdown()
    reloaded = await Tenant.load(tenant.path, tenant.tenant_id, JOBS)
    assert await reloaded.timelines[tl.timeline_id].get(_key(1), Lsn(0x100)) == b"whole"
    await reloaded.shutdown()


async def test_load_refuses_to_delete_files_no_index_part_lists(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), JOBS)
    tl = await tenant.create_timeline(TimelineId.generate())
    await tl.put(_key(1), Lsn(0x100), Image(b"v"))
    tl.finish_write(Lsn(0x100))
    await tl.flush()
    await tenant.shutdown()
    (tl.path / "index_part.json").unlink()  # lost by an operator, say
    layers = sorted(p.name for p in tl.path.iterdir())
    assert layers
    with pytest.raises(LayerCorruptionError, match="not deleting what nothing lists"):
        await Tenant.load(tmp_path, tenant.tenant_id, JOBS)
    assert sorted(p.name for p in tl.path.iterdir()) == layers
    # An interrupted create_timeline (nothing but a temp file) is still cleaned up.
    other = tenant.timelines_dir / TimelineId.generate().hex
    other.mkdir()
    (other / "index_part.json.___temp").write_bytes(b"{")
    (tl.path / "index_part.json.___temp").write_bytes(b"{")
    for name in layers:
        (tl.path / name).unlink()
    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, JOBS)
    assert reloaded.timelines == {} and not other.exists() and not tl.path.exists()
    await reloaded.shutdown()


async def test_a_timeline_being_imported_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetPage and basebackup look timelines up with get_timeline: half an import must not be
    readable through it (a base backup's pages are only consistent once all its WAL is in)."""
    source = tmp_path / "pgdata"
    source.mkdir()
    halfway, go_on = trio.Event(), trio.Event()

    async def slow_import(tl: Timeline, src: Path, *, wal_tar: Path | None = None) -> None:
        await tl.put(_key(1), Lsn(0x100), Image(b"half"))
        tl.finish_write(Lsn(0x100))
        halfway.set()
        await go_on.wait()

    monkeypatch.setattr(tm, "import_datadir", slow_import)
    manager = TenantManager(PageserverConfig(workdir=tmp_path / "ps", tenant_config=JOBS))
    tenant = await manager.create_tenant()
    tid = TimelineId.generate()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.import_timeline, tenant.tenant_id, tid, source)
        await halfway.wait()
        assert tid in tenant.timelines
        with pytest.raises(TimelineNotFoundError, match="still being created"):
            manager.get_timeline(tenant.tenant_id, tid)
        go_on.set()
    assert manager.get_timeline(tenant.tenant_id, tid).last_record_lsn == 0x100
    await manager.shutdown()


async def test_a_failed_wal_ingest_stops_that_timeline_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingest error that is not a lost connection (which the receiver retries) is logged
    and shown by the HTTP API; it does not end the node, nor the other timelines' ingest."""
    running: list[TimelineId] = []
    failing: list[TimelineId] = []

    class FakeIngest:
        def __init__(self, tl: Timeline, cfg: object, *, ingest: object,
                     remote_wal: object = None) -> None:
            self.tl = tl
            self.receiver = None

        async def pause(self) -> None:  # shutdown stops each ingest between two records
            await trio.lowlevel.checkpoint()

        async def run(self) -> None:
            running.append(self.tl.timeline_id)
            if self.tl.timeline_id in failing:
                raise RuntimeError("a record the ingest cannot apply")
            await trio.sleep_forever()

    monkeypatch.setattr(tm, "TimelineWalIngest", FakeIngest)
    conf = PageserverConfig(workdir=tmp_path, tenant_config=JOBS, safekeepers=("127.0.0.1:1",))
    with capture_logs() as logs, trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            manager = TenantManager(conf)
            await manager.start(nursery)
            tenant = await manager.create_tenant()
            first = await tenant.create_timeline(TimelineId.generate())
            second = await tenant.create_timeline(TimelineId.generate())
            failing.append(first.timeline_id)
            manager._start_ingest(first)
            manager._start_ingest(second)
            while len(running) < 2:
                await trio.sleep(0.01)
            assert manager.ingest_failures == {
                (tenant.tenant_id, first.timeline_id): "ingest stopped at 0/0: "
                "RuntimeError('a record the ingest cannot apply')"
            }
            assert sorted(running) == sorted([first.timeline_id, second.timeline_id])
            await trio.sleep(0.1)
            assert manager.ingest_of(tenant.tenant_id, second.timeline_id) is not None
            await manager.shutdown()
            nursery.cancel_scope.cancel()
    failed = [e for e in logs if e["event"].startswith("WAL ingest failed")]
    assert [e["timeline_id"] for e in failed] == [first.timeline_id.hex] and failed[0]["exc_info"]
