"""Layer objects compressed by the L0 writer process (``remote_compression.stage_layer``) and
sent as they are by the upload queue (``RemoteTimelineClient._prepare``).

- A timeline whose L0s the worker process writes: every such L0 goes up as the object the
  worker staged (the pageserver's process compresses nothing), the remote object is exactly
  the bytes the index describes (its ``compressed_size``, and it decompresses to the layer file
  byte for byte), no staged or temp file is left, and a fresh node attaches and reads it all
  back; over the local kind and SeaweedFS.
- A staged object that is missing, torn (cut short, bytes after its frame, a flipped header),
  of another codec, made from an older layer file, or not a file at all is not sent: it is
  removed, the upload compresses the layer itself, and the object it sends decompresses to
  the layer; an intact one is sent byte for byte.
- The worker answers before it stages (the flush does not wait for the codec) and the upload
  waits for the staging (its locked claim) and then sends it; a claim let go without a staged
  object (a worker that died) makes the upload compress the layer itself.
- A PUT that fails is retried with the same object (nothing compressed again); a queue that
  is not active, or uploads stored as they are, ask the worker to stage nothing; a staging
  that fails in the worker is not a failed flush (the upload compresses the L0 instead).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
import zstandard
from prometheus_client import REGISTRY

from pageserver import remote_compression as rc
from pageserver import remote_layout
from pageserver.remote_tenant import TenantRemote, find_index
from pageserver.remote_timeline import RemoteTimelineClient
from pageserver.storage.config import StorageConfig
from pageserver.storage.index_part import IndexPart, StoredLayer
from pageserver.storage.key import rel_block_key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from remote_storage import LocalStorageConfig, RemoteStorage, make_remote_storage
from tests.pageserver.remote_helpers import FaultyStorage, check_remote_invariant

CFG = StorageConfig(
    validate_get=True, double_buffering=False, gc_horizon=0, pitr_interval_s=0,
    compaction_period_s=0, gc_period_s=0, checkpoint_distance=1 << 20,
    l0_writer="process", l0_writer_min_bytes=0,
)
PAGE = 8192


def _page(i: int) -> bytes:
    """Compressible, distinct pages (a row-like pattern with the number in it)."""
    return (b"row %08d filler " % i + b" " * 40) * (PAGE // 58) + bytes(PAGE % 58)


def _counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def _ingest(tl: Timeline, n: int, start: int = 0) -> None:
    lsn = tl.last_record_lsn
    for i in range(start, start + n):
        lsn = Lsn(lsn + 0x40)
        await tl.put(rel_block_key(1663, 5, 16384, 0, i), lsn, Image(_page(i)))
        tl.finish_write(lsn)
    await tl.flush()


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "___temp" in p.name)


async def test_l0s_go_up_as_the_worker_staged_them_and_load_back(
    remote_store: RemoteStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_process: list[str] = []
    real = rc.compress_file

    def counting(src: Path, dst: Path, level: int, codec: rc.Codec = "zstd") -> tuple[int, int]:
        in_process.append(src.name)
        return real(src, dst, level, codec)

    # (the worker is another process: only the pageserver's own compressions are counted)
    monkeypatch.setattr(rc, "compress_file", counting)
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    staged0 = _counter("pageserver_remote_staged_layers_total")
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=TenantRemote(remote_store, 1, stage_in_l0_writer=True))
        tl = await tenant.create_timeline(timeline_id)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        for r in range(3):
            await _ingest(tl, 40, r * 40)
        await tl.remote.wait_uploaded()
        assert tl.l0_worker.jobs == 3  # (one L0 per flush)
        assert in_process == [], "the pageserver compressed a layer the worker had staged"
        assert _counter("pageserver_remote_staged_layers_total") - staged0 == 3
        assert _leftovers(tl.path) == []
        found = await find_index(remote_store, tenant_id, timeline_id, 1)
        assert found is not None
        part = found[1]
        assert len(part.layers) == 3
        for name, size in part.layers.items():
            stored = part.stored_layer(name)
            assert stored.compression == "zstd"
            obj = await remote_store.download(remote_layout.layer_key(tenant_id, timeline_id, name, 1))
            assert len(obj) == stored.size
            assert zstandard.ZstdDecompressor().decompress(obj) == (tl.path / name).read_bytes()
            assert size == (tl.path / name).stat().st_size
        assert await check_remote_invariant(remote_store) == 1
        lsn = tl.last_record_lsn
        await tenant.shutdown()

        # a fresh node (empty disk) attaches and reads every page back through those objects
        restored = await Tenant.load(tmp_path / "b", tenant_id, CFG, nursery=nursery,
                                     remote=TenantRemote(remote_store, 2, stage_in_l0_writer=True))
        rtl = restored.timelines[timeline_id]
        for i in range(120):
            assert await rtl.get(rel_block_key(1663, 5, 16384, 0, i), lsn) == _page(i)
        await restored.shutdown()
        nursery.cancel_scope.cancel()


def _layer(tmp: Path, name: str = "layer") -> Path:
    path = tmp / name
    path.write_bytes(b"".join(_page(i) for i in range(64)) + random.Random(1).randbytes(4096))
    return path


async def _upload(client: RemoteTimelineClient, path: Path) -> IndexPart:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.activate()
        client.schedule_index_upload(IndexPart(layers={path.name: path.stat().st_size},
                                               disk_consistent_lsn=Lsn(0x100)))
        await client.wait_uploaded()
        nursery.cancel_scope.cancel()
    assert client.uploaded_index is not None
    return client.uploaded_index


def _torn_cut(staged: Path, layer: Path) -> None:
    staged.write_bytes(staged.read_bytes()[:-7])


def _torn_tail(staged: Path, layer: Path) -> None:
    staged.write_bytes(staged.read_bytes() + b"\0" * 16)


def _other_size(staged: Path, layer: Path) -> None:
    # a frame of a layer of another size (another layer's object under this name)
    staged.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(layer.read_bytes()[:-1]))


def _other_codec(staged: Path, layer: Path) -> None:
    rc.compress_file(layer, staged, 1, "lz4")


def _older_than_the_layer(staged: Path, layer: Path) -> None:
    st = layer.stat()
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))


def _not_a_file(staged: Path, layer: Path) -> None:
    staged.unlink()
    staged.mkdir()


def _missing(staged: Path, layer: Path) -> None:
    staged.unlink()


@pytest.mark.parametrize("damage", [_torn_cut, _torn_tail, _other_size, _other_codec, _older_than_the_layer,
                                    _not_a_file, _missing])
async def test_a_staged_object_that_does_not_pass_is_remade(tmp_path: Path, damage: object) -> None:
    assert callable(damage)
    storage = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    path = _layer(tmp_path)
    assert rc.stage_layer(path, rc.StageSpec("zstd", 1, True)) is not None
    staged = rc.staged_path(path)
    damage(staged, path)
    rejected0 = _counter("pageserver_remote_rejected_staged_layers_total")
    staged0 = _counter("pageserver_remote_staged_layers_total")
    client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                  stage_in_l0_writer=True)
    part = await _upload(client, path)
    stored = part.stored_layer(path.name)
    assert stored.compression == "zstd"
    obj = await storage.download(client.layer_key(path.name, 1))
    assert len(obj) == stored.size
    assert zstandard.ZstdDecompressor().decompress(obj) == path.read_bytes()
    assert _counter("pageserver_remote_staged_layers_total") == staged0
    rejected = _counter("pageserver_remote_rejected_staged_layers_total") - rejected0
    assert rejected == (0 if damage is _missing else 1)
    if damage is _not_a_file:  # (not ours to remove: left as it is, never sent)
        assert staged.is_dir()
        staged.rmdir()
    assert not staged.exists() and _leftovers(tmp_path) == []
    await storage.aclose()


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
async def test_an_intact_staged_object_is_sent_byte_for_byte(
    tmp_path: Path, codec: rc.Codec, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    path = _layer(tmp_path)
    size = rc.stage_layer(path, rc.StageSpec(codec, 1, True))
    assert size is not None
    staged_bytes = rc.staged_path(path).read_bytes()

    def refuse(*args: object) -> tuple[int, int]:
        raise AssertionError("the upload compressed a layer whose staged object is intact")

    monkeypatch.setattr(rc, "compress_file", refuse)
    client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                  compression=codec, stage_in_l0_writer=True)
    # the first PUT fails: the retry sends the same object (the staged one is used up by then)
    storage.fail("upload", "*" + path.name + "*", times=1)
    part = await _upload(client, path)
    assert part.stored_layer(path.name) == StoredLayer(codec, size)
    assert await storage.inner.download(client.layer_key(path.name, 1)) == staged_bytes
    assert [op for op, key in storage.calls if op == "upload" and path.name in key] == ["upload"] * 2
    assert _leftovers(tmp_path) == []
    await storage.inner.aclose()


def test_stage_spec_follows_the_queue(tmp_path: Path) -> None:
    storage = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                  compression_level=3, compression_probe=False, stage_in_l0_writer=True)
    assert client.stage_spec() is None, "an inactive queue may never upload the layer"
    client.activate()
    assert client.stage_spec() == rc.StageSpec("zstd", 3, False)
    client.stop()
    assert client.stage_spec() is None
    uncompressed = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                        compression="none", stage_in_l0_writer=True)
    by_default = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path)
    for other in (uncompressed, by_default):  # nothing to stage; staging is off by default
        other.activate()
        assert other.stage_spec() is None


def test_an_incompressible_layer_is_not_staged(tmp_path: Path) -> None:
    path = tmp_path / "random"
    path.write_bytes(random.Random(2).randbytes(1 << 20))
    assert rc.stage_layer(path, rc.StageSpec("zstd", 1, True)) is None
    assert rc.stage_layer(path, rc.StageSpec("zstd", 1, False)) is None  # the frame is no smaller
    assert _leftovers(tmp_path) == []


async def test_a_failed_staging_is_not_a_failed_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged path is taken by a directory: the worker's staging fails (and says so on its
    stderr), the L0 is still published, and the upload compresses it itself."""
    store = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    compressed: list[str] = []
    real = rc.compress_file

    def counting(src: Path, dst: Path, level: int, codec: rc.Codec = "zstd") -> tuple[int, int]:
        compressed.append(src.name)
        return real(src, dst, level, codec)

    monkeypatch.setattr(rc, "compress_file", counting)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), CFG, nursery=nursery, remote=TenantRemote(store, 1, stage_in_l0_writer=True))
        tl = await tenant.create_timeline(TimelineId.generate())
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        lsn = tl.last_record_lsn
        for i in range(40):
            lsn = Lsn(lsn + 0x40)
            await tl.put(rel_block_key(1663, 5, 16384, 0, i), lsn, Image(_page(i)))
            tl.finish_write(lsn)
        await tl.freeze()
        name = tl.frozen_layers[0].l0_desc().file_name()
        (tl.path / (name + rc.STAGED_SUFFIX)).mkdir()
        await tl.flush()
        assert tl.disk_consistent_lsn == lsn
        await tl.remote.wait_uploaded()
        assert compressed == [name]
        assert tl.remote.uploaded_index is not None
        assert tl.remote.uploaded_index.stored_layer(name).compression == "zstd"
        assert _leftovers(tl.path) == [name + rc.STAGED_SUFFIX]  # (the directory, left alone)
        await tenant.shutdown()
        nursery.cancel_scope.cancel()
    await store.aclose()


async def test_the_flush_does_not_wait_for_the_staging_and_the_upload_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pageserver.storage.l0_worker import L0Worker

    def refuse(*args: object) -> tuple[int, int]:
        raise AssertionError("the upload compressed a layer the worker was staging")

    monkeypatch.setattr(rc, "compress_file", refuse)
    store = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    staged0 = _counter("pageserver_remote_staged_layers_total")
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), CFG, nursery=nursery, remote=TenantRemote(store, 1, stage_in_l0_writer=True))
        tl = await tenant.create_timeline(TimelineId.generate())
        tl.l0_worker = L0Worker(worker_args=["--stage-stall-s=3"])
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        await _ingest(tl, 40)
        (layer,) = [x.path for x in tl.layer_map]
        assert not rc.wait_staging(layer, 0), "the flush returned only once the staging was done"
        await tl.remote.wait_uploaded()
        assert rc.wait_staging(layer, 0)
        assert _counter("pageserver_remote_staged_layers_total") - staged0 == 1
        assert tl.remote.uploaded_index is not None
        assert tl.remote.uploaded_index.stored_layer(layer.name).compression == "zstd"
        assert _leftovers(tl.path) == []
        await tenant.shutdown()
        nursery.cancel_scope.cancel()
    await store.aclose()


@pytest.mark.parametrize("finish", [True, False])
async def test_the_upload_waits_for_a_claimed_staging(tmp_path: Path, finish: bool) -> None:
    """A claim held: the upload waits; let go after staging: the staged object is sent; let go
    with half an object in the temp file and no staged one (a worker killed mid-staging): the
    upload compresses the layer itself."""
    storage = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    path = _layer(tmp_path)
    claim = rc.begin_staging(path)
    staged0 = _counter("pageserver_remote_staged_layers_total")
    client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                  stage_in_l0_writer=True)
    done = trio.Event()
    part: list[IndexPart] = []

    async def upload() -> None:
        part.append(await _upload(client, path))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(upload)
        with trio.move_on_after(0.5):
            await done.wait()
        assert not done.is_set(), "the upload did not wait for the staging"
        if finish:
            assert rc.stage_layer(path, rc.StageSpec("zstd", 1, True)) is not None
            staged_bytes = rc.staged_path(path).read_bytes()
        else:
            os.write(claim, b"\x28\xb5\x2f\xfd half a frame")
        os.close(claim)
        await done.wait()
    stored = part[0].stored_layer(path.name)
    obj = await storage.download(client.layer_key(path.name, 1))
    assert stored.compression == "zstd" and len(obj) == stored.size
    assert zstandard.ZstdDecompressor().decompress(obj) == path.read_bytes()
    assert _counter("pageserver_remote_staged_layers_total") - staged0 == (1 if finish else 0)
    if finish:
        assert obj == staged_bytes
    assert _leftovers(tmp_path) == []
    await storage.aclose()
