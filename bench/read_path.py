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
from typing import Any

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
    tl: Timeline, keys: list[Key], lsn: Lsn, batch: int, path: str, cold: bool, seconds: float
) -> dict[str, Any]:
    rng = random.Random(batch)
    engine = tl.engine
    index_cache = tl.index_cache
    batches = 0
    busy = 0.0
    engine.stats.reset()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or batches < 3:
        start = rng.randrange(0, len(keys) - batch + 1)
        want = keys[start : start + batch]
        if cold:
            _drop_os_cache(tl)
            index_cache.clear()
        t0 = time.perf_counter()
        if path == "vectored":
            got = await tl.get_vectored(want, lsn)
            assert len(got) == batch
        else:
            for key in want:
                await tl.get(key, lsn)
        busy += time.perf_counter() - t0
        batches += 1
    stats = engine.stats
    return {
        "batches": batches,
        "keys_per_s": round(batches * batch / busy, 1),
        "batch_latency_us": round(busy / batches * 1e6, 1),
        "preadv_per_batch": round(stats.preadvs / batches, 2),
        "pread_per_batch": round(stats.preads / batches, 2),
    }


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
        for shape in ("deep_l0", "l1", "image"):
            if shape == "l1":
                tl.config = cfg = attrs_evolve(cfg, compaction_threshold=2, image_creation_threshold=1_000_000)
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
                    for path in ("vectored", "legacy"):
                        tl.config = attrs_evolve(cfg, get_impl=path)
                        m = await _measure(tl, keys, lsn, batch, path, cache == "cold", args.seconds)
                        row.update({f"{path}_{k}": v for k, v in m.items()})
                    row["speedup"] = round(row["vectored_keys_per_s"] / row["legacy_keys_per_s"], 2)
                    row["peak_rss_mib"] = round(_peak_rss_mib(), 1)
                    print(json.dumps(row), flush=True)
            tl.config = cfg
        await tenant.shutdown()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def attrs_evolve(cfg: StorageConfig, **changes: Any) -> StorageConfig:
    import attrs

    return attrs.evolve(cfg, **changes)


def run(args: argparse.Namespace) -> int:
    return trio.run(_main, args)
