"""Compaction's L0 -> L1 merge writes its entries with ``LayerFileWriter.put_many`` in batches;
the L1 files must be byte for byte (and name for name) what the per-entry path writes: the
merged entries put one by one with ``put``, files cut at the first key change once one holds
``compaction_target_size`` bytes. Values of every size (empty, small, over an index block),
keys with hundreds of LSNs (over several index blocks), batches cut anywhere, the merge's
input and output lists of any size; a mutant that forgets the batched bytes when deciding
where to cut is caught. The oracle sorts every L0's entries itself, so the batched k-way merge
(``_merged``, runs taken as slices) is checked too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pageserver.storage import compaction
from pageserver.storage.compaction import compact_level0
from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.key import Key, KeyRange, key_next, rel_block_key
from pageserver.storage.layer_file import (
    DATA_START,
    LayerCorruptionError,
    LayerDesc,
    LayerFileWriter,
)
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

TARGET = 24 * 1024


def _config() -> StorageConfig:
    return StorageConfig(
        checkpoint_distance=1 << 30,  # the test flushes its L0s itself
        compaction_threshold=3,
        compaction_target_size=TARGET,
        gc_horizon=0,
        pitr_interval_s=0,
        double_buffering=False,
        write_buffer_size=4096,
        io_engine="blocking",
    )


async def _fill(tl: Timeline, seed: int) -> None:
    """Four L0s: a few hot keys with many LSNs, many cold ones, values of every size."""
    rng = random.Random(seed)
    keys = [rel_block_key(1663, 5, 1000 + r, 0, b) for r in range(3) for b in range(40)]
    hot = keys[:3]
    lsn = 0x100
    for _ in range(4):
        for _ in range(rng.randint(60, 160)):
            lsn += 0x10
            chosen = rng.sample(keys, rng.randint(1, 4)) + hot
            for key in sorted(set(chosen)):
                size = rng.choice([0, 1, 30, 150, 150, 700, 9000])
                await tl.put(key, Lsn(lsn), Image(rng.randbytes(size)))
            tl.finish_write(Lsn(lsn))
        await tl.flush()


async def _per_entry_oracle(tl: Timeline, out: Path) -> list[Path]:
    """Every L0's entries (``iter_entries``, one by one) sorted by (key, lsn), ``put`` one by
    one, cut as compaction cuts."""
    l0s = tl.layer_map.l0_layers()
    desc = LayerDesc(KeyRange.full(), l0s[0].desc.lsn_start, l0s[-1].desc.lsn_end, True)
    entries = [entry for layer in l0s async for entry in layer.iter_entries()]
    entries.sort(key=lambda e: (e[0], e[1]))
    paths: list[Path] = []
    writer: LayerFileWriter | None = None
    for key, lsn, blob, will_init in entries:
        if writer is not None and writer.data_size >= TARGET and key != writer.last_key:
            paths.append(await _finish(writer))
            writer = None
        if writer is None:
            writer = await LayerFileWriter.create(tl.engine, out, desc, tl.write_options())
        await writer.put(key, lsn, blob, will_init)
    assert writer is not None
    paths.append(await _finish(writer))
    return paths


async def _finish(writer: LayerFileWriter) -> Path:
    first, last = writer.first_key, writer.last_key
    assert first is not None and last is not None
    return await writer.finish(KeyRange(first, key_next(Key(last))))


@pytest.mark.parametrize(
    ("seed", "batch", "read_bytes", "out_size"),
    [(1, 2048, 1 << 20, 4096), (2, 7, 3000, 5), (3, 1, 1, 1), (4, 194, 20_000, 300), (5, 195, 9000, 64)],
)
async def test_batched_merge_writes_the_per_entry_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, batch: int, read_bytes: int, out_size: int
) -> None:
    monkeypatch.setattr(compaction, "MERGE_BATCH", batch)
    monkeypatch.setattr(compaction._merged, "__defaults__", (out_size,))
    monkeypatch.setattr(PersistentLayer.iter_entry_batches, "__defaults__", (read_bytes,))
    tenant = Tenant(tmp_path / "t", TenantId.generate(), _config())
    tl = await tenant.create_timeline(TimelineId.generate())
    await _fill(tl, seed)
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    want = await _per_entry_oracle(tl, oracle_dir)
    assert len(want) >= 3  # several L1s: the cut points are tested
    got = await compact_level0(tl)
    assert [x.path.name for x in got] == [p.name for p in want]
    for layer, path in zip(got, want, strict=True):
        assert layer.path.read_bytes() == path.read_bytes(), path.name
    await tenant.shutdown()


async def test_a_mutant_cutting_without_the_batched_bytes_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the mutant: the batched entries' bytes not counted, so files are cut elsewhere
    source = Path(compaction.__file__).read_text()
    assert "filled += len(blob)" in source
    mutant = source.replace("filled += len(blob)", "filled += 0")
    namespace: dict[str, object] = {"__name__": "compaction_mutant"}
    exec(compile(mutant, "compaction_mutant", "exec"), namespace)
    monkeypatch.setitem(namespace, "MERGE_BATCH", 64)
    tenant = Tenant(tmp_path / "t", TenantId.generate(), _config())
    tl = await tenant.create_timeline(TimelineId.generate())
    await _fill(tl, 1)
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    want = await _per_entry_oracle(tl, oracle_dir)
    mutant_compact = namespace["compact_level0"]
    got = await mutant_compact(tl)  # type: ignore[operator]
    assert [x.path.name for x in got] != [p.name for p in want]
    await tenant.shutdown()


async def test_a_corrupted_blob_stops_the_merge(tmp_path: Path) -> None:
    # the batched read checks every blob's crc32c, as the per-entry read did
    tenant = Tenant(tmp_path / "t", TenantId.generate(), _config())
    tl = await tenant.create_timeline(TimelineId.generate())
    await _fill(tl, 6)
    l0s = tl.layer_map.l0_layers()
    victim = l0s[2].path
    with open(victim, "r+b") as f:
        f.seek(DATA_START + 5000)
        byte = f.read(1)[0]
        f.seek(DATA_START + 5000)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(LayerCorruptionError, match="checksum mismatch"):
        await compact_level0(tl)
    assert tl.layer_map.l0_layers() == l0s
    await tenant.shutdown()
