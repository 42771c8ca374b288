"""``pagestore bench read-path``: vectored ``get_vectored`` vs N legacy ``get``s.

Builds one timeline: 8 KiB base images for ``--keys`` keys in the first L0, then ``--layers``
L0 layers in which a random ``--update-fraction`` of the keys gets a small Test record (like
Neon's benchmark, where each pgbench run leaves an L0 touching a small part of the table: every
read walks the whole stack of L0s, which cover the whole key range, down to the base image), then
measures, for batch sizes 1..32 of adjacent keys:

- ``vectored``: one ``get_vectored(batch, lsn)`` per batch;
- ``legacy``: ``len(batch)`` calls of ``get(key, lsn)`` with ``get_impl = "legacy"``;

over three layer shapes (``deep_l0``: the stack as built; ``l1``: after L0 -> L1 compaction;
``image``: after image layer creation) and two cache states (``hot``: OS page cache and layer
index blocks warm; ``cold``: ``posix_fadvise(DONTNEED)`` on every layer file and the index block
cache dropped before each batch). The materialized page cache is off (it would turn every
repeated read into a hit). One JSON object per configuration on stdout, including ``preadv``
and ``pread`` calls per batch and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

from pageserver.storage.config import StorageConfig
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import Image, TestRecord
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, default=2048, help="number of 8 KiB pages")
    parser.add_argument("--layers", type=int, default=20, help="L0 layers of records above the base")
    parser.add_argument(
        "--update-fraction", type=float, default=0.1,
        help="share of the keys that get a record in each L0 layer (pgbench-like: few)",
    )
    parser.add_argument("--seconds", type=float, default=0.5, help="time per configuration and path")
    parser.add_argument("--io-engine", choices=("blocking", "threadpool"), default="blocking")
    parser.add_argument("--shapes", default="deep_l0,l1,image", help="comma-separated layer shapes")
    parser.add_argument("--caches", default="hot,cold", help="comma-separated cache states")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument(
        "--ingest-mib", type=int, default=64,
        help="also put this many MiB of 100-byte values into one in-memory layer and report the "
        "RSS it costs per value (0: skip)",
    )


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _drop_os_cache(tl: Timeline) -> None:
    for layer in tl.layer_map:
        fd = layer.reader.file.fd
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


async def _build(tl: Timeline, keys: list[Key], layers: int, update_fraction: float) -> Lsn:
    rng = random.Random(1)
    lsn = 0
    for i, key in enumerate(keys):
        lsn += 8
        await tl.put(key, Lsn(lsn), Image(bytes([i % 251]) * 8192))
        tl.finish_write(Lsn(lsn))
    await tl.flush()
    for layer in range(layers):
        for key in keys:
            if rng.random() >= update_fraction:
                continue
            lsn += 8
            await tl.put(key, Lsn(lsn), TestRecord.wal_append(f",{layer:02d}" + "." * 60))
            tl.finish_write(Lsn(lsn))
        await tl.flush()
    return Lsn(lsn)


async def _measure(
    tl: Timeline, cfg: StorageConfig, keys: list[Key], lsn: Lsn, batch: int, cold: bool, seconds: float
) -> dict[str, Any]:
    """Both paths on the same random batches, interleaved batch by batch (each going first
    every other batch), so a noisy neighbour on the machine slows both alike."""
    rng = random.Random(batch)
    engine = tl.engine
    paths: tuple[Literal["vectored", "legacy"], ...] = ("vectored", "legacy")
    configs = {p: attrs.evolve(cfg, get_impl=p) for p in paths}
    busy = dict.fromkeys(paths, 0.0)
    cpu = dict.fromkeys(paths, 0.0)
    preadvs = dict.fromkeys(paths, 0)
    preads = dict.fromkeys(paths, 0)
    batches = 0
    deadline = time.perf_counter() + 2 * seconds
    while time.perf_counter() < deadline or batches < 3:
        start = rng.randrange(0, len(keys) - batch + 1)
        want = keys[start : start + batch]
        # alternate which path goes first: the second one finds the batch's index blocks and
        # pages warm in the CPU caches, which favoured legacy when vectored always led
        for path in paths if batches % 2 == 0 else paths[::-1]:
            tl.config = configs[path]
            if cold:
                _drop_os_cache(tl)
                tl.index_cache.clear()
            engine.stats.reset()
            t0 = time.perf_counter()
            c0 = time.process_time()
            if path == "vectored":
                got = await tl.get_vectored(want, lsn)
                assert len(got) == batch
            else:
                for key in want:
                    await tl.get(key, lsn)
            cpu[path] += time.process_time() - c0
            busy[path] += time.perf_counter() - t0
            preadvs[path] += engine.stats.preadvs
            preads[path] += engine.stats.preads
        batches += 1
    tl.config = cfg
    out: dict[str, Any] = {"batches": batches}
    for path in paths:
        out[f"{path}_keys_per_s"] = round(batches * batch / busy[path], 1)
        out[f"{path}_batch_latency_us"] = round(busy[path] / batches * 1e6, 1)
        out[f"{path}_cpu_us_per_batch"] = round(cpu[path] / batches * 1e6, 1)
        out[f"{path}_preadv_per_batch"] = round(preadvs[path] / batches, 2)
        out[f"{path}_pread_per_batch"] = round(preads[path] / batches, 2)
    return out


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


async def _ingest_memory(work: Path, mib: int) -> dict[str, Any]:
    """RSS cost of an in-memory layer full of small values (issue 3's memory goal)."""
    cfg = StorageConfig(checkpoint_distance=1 << 40, checkpoint_timeout_s=1e9, double_buffering=False)
    tenant = Tenant(work / "ingest", TenantId.generate(), cfg)
    tl = await tenant.create_timeline(TimelineId.generate())
    value = TestRecord.wal_append("x" * 86)  # 100 bytes encoded
    n_keys = 50_000
    keys = [rel_block_key(1663, 5, 20000 + i // 10_000, 0, i % 10_000) for i in range(n_keys)]
    for key in keys[:n_keys]:
        await tl.put(key, Lsn(1), Image(b"base"))
    tl.finish_write(Lsn(1))
    before = _rss_mib()
    t0 = time.perf_counter()
    n = (mib << 20) // 100
    for i in range(n):
        lsn = Lsn(2 + i)
        await tl.put(keys[i % n_keys], lsn, value)
    tl.finish_write(Lsn(1 + n))
    seconds = time.perf_counter() - t0
    after = _rss_mib()
    assert tl.open_layer is not None
    row = {
        "bench": "read-path",
        "case": "inmemory-ingest",
        "values": n,
        "value_bytes": 100,
        "keys": n_keys,
        "layer_bytes_mib": round(tl.open_layer.size / (1 << 20), 1),
        "rss_growth_mib": round(after - before, 1),
        "rss_bytes_per_value": round((after - before) * (1 << 20) / n, 1),
        "puts_per_s": round(n / seconds),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
    }
    await tenant.shutdown()
    return row


async def _main(args: argparse.Namespace) -> int:
    work = args.dir or Path(tempfile.mkdtemp(prefix="pagestore-bench-read-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = StorageConfig(
        checkpoint_distance=1 << 40,
        checkpoint_timeout_s=1e9,
        compaction_threshold=1_000_000,
        page_cache_size=0,
        double_buffering=False,
        io_engine=args.io_engine,
    )
    try:
        tenant = Tenant(work, TenantId.generate(), cfg)
        tl = await tenant.create_timeline(TimelineId.generate())
        keys = [rel_block_key(1663, 5, 16384, 0, blk) for blk in range(args.keys)]
        t0 = time.perf_counter()
        lsn = await _build(tl, keys, args.layers, args.update_fraction)
        build_s = time.perf_counter() - t0
        shapes = [s for s in args.shapes.split(",") if s]
        caches = [c for c in args.caches.split(",") if c]
        if bad := sorted(set(shapes) - {"deep_l0", "l1", "image"}):
            raise SystemExit(f"unknown --shapes {', '.join(bad)}: choose from deep_l0, l1, image")
        if bad := sorted(set(caches) - {"hot", "cold"}):
            raise SystemExit(f"unknown --caches {', '.join(bad)}: choose from hot, cold")
        for shape in ("deep_l0", "l1", "image"):
            if shape == "l1":
                tl.config = cfg = attrs.evolve(cfg, compaction_threshold=2, image_creation_threshold=1_000_000)
                await tl.compact()
            elif shape == "image":
                await tl.compact(force_image=True)
            if shape not in shapes:
                continue
            n_layers = len(tl.layer_map)
            for cache in caches:
                for batch in BATCH_SIZES:
                    row: dict[str, Any] = {
                        "bench": "read-path",
                        "shape": shape,
                        "layers": n_layers,
                        "cache": cache,
                        "batch": batch,
                        "keys": args.keys,
                        "io_engine": args.io_engine,
                        "update_fraction": args.update_fraction,
                        "build_s": round(build_s, 2),
                    }
                    row.update(await _measure(tl, cfg, keys, lsn, batch, cache == "cold", args.seconds))
                    row["speedup"] = round(row["vectored_keys_per_s"] / row["legacy_keys_per_s"], 2)
                    # CPU time of the process (all threads) per batch: steadier than wall
                    # time on a loaded machine; equal to it when nothing else runs
                    row["cpu_speedup"] = round(
                        row["legacy_cpu_us_per_batch"] / max(row["vectored_cpu_us_per_batch"], 1e-9), 2
                    )
                    row["peak_rss_mib"] = round(_peak_rss_mib(), 1)
                    print(json.dumps(row), flush=True)
            tl.config = cfg
        await tenant.shutdown()
        if args.ingest_mib > 0:
            print(json.dumps(await _ingest_memory(work, args.ingest_mib)), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def run(args: argparse.Namespace) -> int:
    return trio.run(_main, args)
