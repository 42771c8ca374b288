"""``stop`` while the upload worker is inside an await leaves it to end quietly.

``Tenant.shutdown`` calls the client's ``stop`` (which drops the queue and unpins the layers
still queued) before the timeline's shutdown cancels the worker, so the worker can find the
queue empty when its await returns: during a layer batch's upload, and during the coalescer's
``on_unpinned`` callback (the graveyard's collection). It must end without touching the emptied
queue (an ``IndexError`` in the timeline's nursery) and without unpinning a layer twice (the
pins are shared with the graveyard: a second unpin drops another holder's pin).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

from pageserver.remote_timeline import RemoteTimelineClient
from pageserver.storage.index_part import IndexPart
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from remote_storage import LocalStorageConfig, RemoteStorage, make_remote_storage


async def _run_until_stopped(client: RemoteTimelineClient) -> list[BaseException]:
    errors: list[BaseException] = []

    async def run() -> None:
        try:
            await client.run()
        except BaseException as exc:  # the test reports whatever ended it
            errors.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while not client.stopped or client._worker_running:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    return errors


def _pins(client: RemoteTimelineClient, tmp_path: Path, *names: str) -> list[int]:
    return [client.pins._count[tmp_path / n] for n in names]


async def test_stop_during_a_layer_batch(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 1000)
    inner = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    client: RemoteTimelineClient

    class StopsTheClient:
        """The node goes away while the layer's PUT is in flight."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def upload_file(self, key: str, path: Path) -> Any:
            client.stop()
            return await inner.upload_file(key, path)

    store: RemoteStorage = StopsTheClient()
    client = RemoteTimelineClient(store, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                  compression="none")
    client.activate()
    client.schedule_index_upload(IndexPart(layers={"a": 1000}, disk_consistent_lsn=Lsn(0x100)))
    errors = await _run_until_stopped(client)
    await inner.aclose()
    assert not errors, repr(errors)
    assert _pins(client, tmp_path, "a") == [0]


async def test_stop_while_the_coalescer_awaits_on_unpinned(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"x" * 1000)
    storage = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    client: RemoteTimelineClient
    calls = 0

    async def on_unpinned() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the coalescer's call (the first is layer a's batch)
            client.stop()
        await trio.lowlevel.checkpoint()

    client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                  on_unpinned=on_unpinned, index_upload_interval_s=10.0,
                                  compression="none")
    client.activate()
    # [layer a, index 0, layer b, index 1]: a's batch, then the coalescer uploads b for index 1
    client.schedule_index_upload(IndexPart(layers={"a": 1000}, disk_consistent_lsn=Lsn(0x100)))
    client.schedule_index_upload(
        IndexPart(layers={"a": 1000, "b": 1000}, disk_consistent_lsn=Lsn(0x200)))
    errors = await _run_until_stopped(client)
    await storage.aclose()
    assert calls == 2, "the coalescer's on_unpinned ran"
    assert not errors, repr(errors)
    assert _pins(client, tmp_path, "a", "b") == [0, 0]
