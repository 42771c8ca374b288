"""``pagestore bench remote``: remote storage on a real SeaweedFS (started here unless
``--endpoint`` names an S3 server), one JSON line per measurement:

- ``upload``: ``--upload-mib`` of layer-sized files (``--layer-mib`` each) through a timeline's
  upload queue (``RemoteTimelineClient``: parallel layer PUTs, then the index), against a plain
  boto3 ``put_object`` loop over the same files to the same server (sequential, and with as many
  threads as the queue uses), in ``--rounds`` interleaved rounds: MB/s (medians) and the median
  of the per-round ratios (goal: queue >= 80 % of the plain loop).
- ``ingest``: ``--ingest-mib`` of 8 KiB page images put into a timeline and flushed into L0s
  of ``--ingest-l0-mib`` (default: the node's default ``checkpoint_distance``, 256 MiB; a list
  runs the part once per size, one line each), with uploads off (no remote storage) and on (the
  queue uploading behind the flushes with the node's defaults: layers zstd-compressed unless
  their sample does not compress, index PUTs coalesced), and optionally ``on-uncompressed``
  (layers stored as they are), ``on-signed`` (SigV4 over the body), ``on-no-coalesce`` (an
  index PUT per flush) and ``on-no-probe`` (every layer compressed whole), interleaved over
  ``--rounds`` rounds: MB/s of ingest and the median of the per-round ratios (goal >= 90 %);
  the CPU seconds of the trio thread (the ingest's own work), of the process (the upload
  threads too) and of SeaweedFS (``bench.proc_cpu``); with uploads on, the seconds until
  ``remote_consistent_lsn`` caught up, the bytes sent against the bytes of the layer files, and
  the layer and index PUTs. The pages (``--ingest-pages``) are those of a real pgbench
  database (``pgbench -i -s --ingest-pgbench-scale`` in a PostgreSQL started here, every page
  of its relation files, cycled: how compressible a real database's layers are) or unique
  random pages (incompressible: the worst case for compression).
- ``attach``: a tenant with ``--attach-mib`` of layers (default 1024) in remote storage is
  attached by a fresh node with an empty disk: seconds to attach (list, index, reconcile: no
  layer downloaded), then the latency of the first read of one page (on-demand: fetches only the
  layers it needs: the image layer over that key) and of a second read. The tenant is 64 MiB
  L0s with image layers over them (``compact(force_image=True)``), as reads see a tenant whose
  compaction has run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio
from prometheus_client import REGISTRY

from bench import proc_cpu
from bench.impl_rows import add_impl_option, run_per_impl
from common.logging import setup_logging
from compute.postgres import PostgresInstance, postgres_tmpdir
from pageserver.remote_tenant import TenantRemote
from pageserver.remote_timeline import RemoteTimelineClient
from pageserver.storage.config import StorageConfig
from pageserver.storage.index_part import IndexPart
from pageserver.storage.key import rel_block_key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from remote_storage import S3StorageConfig, make_remote_storage
from remote_storage.config import Compression
from remote_storage.s3 import make_client
from remote_storage.seaweedfs import SeaweedServer

MiB = 1 << 20
PAGE = 8192


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint URL (default: start a SeaweedFS here)")
    parser.add_argument("--upload-mib", type=int, default=256, help="bytes of layer files to upload")
    parser.add_argument("--layer-mib", type=int, default=16, help="size of each layer file")
    parser.add_argument("--ingest-mib", type=int, default=128, help="page images to ingest per configuration")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of the upload (queue, plain loop, threaded loop) and ingest "
                             "(off, on) configurations")
    parser.add_argument("--ingest-pages", choices=("pgbench", "random"), default="pgbench",
                        help="page images to ingest: a real pgbench database's pages, or unique random ones")
    parser.add_argument("--ingest-pgbench-scale", type=int, default=10,
                        help="pgbench scale of that database (10: about 160 MB of pages, cycled)")
    parser.add_argument("--ingest-l0-mib", default=str(StorageConfig().checkpoint_distance // MiB),
                        help="comma-separated L0 sizes (checkpoint_distance, MiB) to run the ingest part at, "
                             "one JSON line each (default: the node's default)")
    parser.add_argument("--ingest-configs", default="off,on",
                        help=f"comma-separated, 'off' first, of {','.join(INGEST_CONFIGS)}")
    parser.add_argument("--cpus", default=None,
                        help="run the benchmark on these CPUs only (e.g. 0; default: all)")
    parser.add_argument("--seaweedfs-cpus", default=None,
                        help="run the SeaweedFS it starts on these CPUs only (e.g. 1: the store on cores "
                             "of its own, as a remote S3 is; default: all)")
    parser.add_argument("--attach-mib", type=int, default=1024, help="layers of the tenant to attach")
    parser.add_argument("--parts", default="upload,ingest,attach", help="comma-separated measurements")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--seaweedfs-dir", type=Path, default=None,
                        help="where the SeaweedFS it starts keeps its data (default: in the work directory, "
                             "the pageserver's disk; e.g. /dev/shm: a store with storage of its own, as a "
                             "remote S3 has)")
    add_impl_option(parser)


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps({"bench": "remote", **obj}), flush=True)


def _s3(endpoint: str, bucket: str) -> S3StorageConfig:
    return S3StorageConfig(
        bucket=bucket, endpoint=endpoint, access_key_id="bench", secret_access_key="bench",
        create_bucket=True,
    )


def _storage_config(checkpoint_mib: int) -> StorageConfig:
    return StorageConfig(
        checkpoint_distance=checkpoint_mib * MiB, compaction_period_s=0, gc_period_s=0,
        validate_get=False, io_engine="threadpool",
    )


# -- upload ----------------------------------------------------------------------------------


def _plain_loop(cfg: S3StorageConfig, files: list[Path], threads: int, prefix: str) -> float:
    client = make_client(cfg)
    client.head_bucket(Bucket=cfg.bucket)

    def put(path: Path) -> None:
        with open(path, "rb") as f:
            client.put_object(Bucket=cfg.bucket, Key=f"{prefix}/{path.name}", Body=f, ContentLength=path.stat().st_size)

    start = time.perf_counter()
    if threads == 1:
        for path in files:
            put(path)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, files))
    elapsed = time.perf_counter() - start
    client.close()
    return elapsed


async def _queue_upload(cfg: S3StorageConfig, files: list[Path], directory: Path) -> tuple[float, int]:
    storage = make_remote_storage(cfg)
    await storage.list("nothing/")  # creates the bucket, opens the connection pool
    client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, directory)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.activate()
        start = time.perf_counter()
        client.schedule_index_upload(IndexPart(layers={p.name: p.stat().st_size for p in files}, disk_consistent_lsn=Lsn(0x100)))
        await client.wait_uploaded()
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    await storage.aclose()
    return elapsed, client.parallel_uploads


def bench_upload(endpoint: str, work: Path, upload_mib: int, layer_mib: int, rounds: int = 3) -> None:
    directory = work / "upload"
    directory.mkdir()
    files = []
    for i in range(max(1, upload_mib // layer_mib)):
        path = directory / f"layer-{i:04d}"
        path.write_bytes(os.urandom(layer_mib * MiB))
        files.append(path)
    total = sum(p.stat().st_size for p in files)
    cfg = _s3(endpoint, "bench-upload")
    parallel = RemoteTimelineClient.DEFAULT_PARALLEL_UPLOADS
    # interleaved rounds, the order rotated, so a warming cache or a neighbour's load does not
    # favour one side; medians and per-round ratios
    names = ("queue", "plain", "plain-threads")
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            if name == "queue":
                seconds[name].append(trio.run(_queue_upload, cfg, files, directory)[0])
            else:
                seconds[name].append(_plain_loop(cfg, files, 1 if name == "plain" else parallel, f"{name}-{r}"))
    mb = total / 1e6
    med = {n: statistics.median(v) for n, v in seconds.items()}
    emit({
        "part": "upload", "bytes": total, "files": len(files), "layer_mib": layer_mib, "rounds": rounds,
        "runs_s": {n: [round(x, 3) for x in v] for n, v in seconds.items()},
        "queue_mb_s": round(mb / med["queue"], 1), "plain_loop_mb_s": round(mb / med["plain"], 1),
        f"plain_{parallel}_threads_mb_s": round(mb / med["plain-threads"], 1),
        "ratio_vs_plain_loop_per_round": [round(p / q, 3) for p, q in zip(seconds["plain"], seconds["queue"], strict=True)],
        "ratio_vs_plain_loop": round(statistics.median(p / q for p, q in zip(seconds["plain"], seconds["queue"], strict=True)), 3),
        "ratio_vs_plain_threads": round(statistics.median(
            p / q for p, q in zip(seconds["plain-threads"], seconds["queue"], strict=True)), 3),
        "goal": ">= 0.8 of the plain loop (median of per-round ratios)",
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    })
    shutil.rmtree(directory)


# -- ingest ----------------------------------------------------------------------------------


def pgbench_pages(scale: int) -> list[bytes]:
    """Every 8 KiB page of a real pgbench database's relation files (tables, indexes, their
    free space and visibility maps) at ``scale``, after a checkpoint."""
    with postgres_tmpdir("pagestore-bench-remote-pg-") as tmp:
        pg = PostgresInstance.create(tmp / "data")
        pg.start()
        try:
            pg.pgbench("-i", "-s", str(scale), "-q")
            pg.psql("VACUUM ANALYZE")
            pg.psql("CHECKPOINT")
            db_oid = pg.psql("SELECT oid FROM pg_database WHERE datname = 'postgres'")
        finally:
            pg.stop()
        pages: list[bytes] = []
        for path in sorted((tmp / "data" / "base" / db_oid).iterdir()):
            if not path.name.split("_")[0].split(".")[0].isdigit():
                continue
            data = path.read_bytes()
            pages += [data[i:i + PAGE] for i in range(0, len(data) - PAGE + 1, PAGE)]
    return pages


def random_pages(mib: int = 32) -> list[bytes]:
    """Unique random pages (``mib`` of them, cycled: far more than a zstd window apart)."""
    return [os.urandom(PAGE) for _ in range(mib * MiB // PAGE)]


def _counter(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _ingest(tl: Timeline, mib: int, pages: list[bytes], start_block: int = 0,
                  cpu: dict[str, Any] | None = None, pids: dict[str, int] | None = None) -> float:
    """Seconds to put and flush ``mib`` of page images (``pages``, cycled); ``cpu`` gets the
    CPU seconds of the trio thread (the ingest's own work) and of the whole process (upload
    threads too), and the breakdown per thread group and per process of ``pids``
    (``bench.proc_cpu``)."""
    n = mib * MiB // PAGE
    lsn = tl.last_record_lsn
    sample = proc_cpu.Sample.take(pids)
    worker_pid = tl.l0_worker.pid
    worker0 = 0.0 if worker_pid is None else proc_cpu.process_cpu(worker_pid) or 0.0
    started = time.perf_counter()
    thread0, process0 = time.thread_time(), time.process_time()
    for i in range(n):
        lsn = Lsn(lsn + 0x40)
        await tl.put(rel_block_key(1663, 5, 16384, 0, start_block + i), lsn, Image(pages[i % len(pages)]))
        tl.finish_write(lsn)
    await tl.flush()
    if cpu is not None:
        cpu["trio_thread_cpu_s"] = time.thread_time() - thread0
        cpu["process_cpu_s"] = time.process_time() - process0
        cpu["cpu"] = proc_cpu.breakdown(sample, proc_cpu.Sample.take(pids))
        # The L0 writer process (started on the first roll, so usually inside this interval):
        # its writes, and with staging the compression of the L0s it wrote (a staging still
        # running after the flush is counted in the next interval, or not at all)
        pid = tl.l0_worker.pid
        if pid is not None:
            cpu["cpu"]["l0_worker_cpu_s"] = round(
                (proc_cpu.process_cpu(pid) or 0.0) - (worker0 if pid == worker_pid else 0.0), 3)
    return time.perf_counter() - started


# off: no remote storage; on: uploads behind the flushes (the node's S3 settings: layers
# zstd-compressed, index PUTs coalesced, incompressible layers stored as they are);
# on-uncompressed: layers stored as they are (``compression = "none"``); on-signed: the node's
# settings with SigV4 over the body (``payload_signing``); on-no-coalesce: one index PUT per
# flush (only back-to-back queued indexes coalesced: ``coalesce_indexes = False``);
# on-no-probe: every layer compressed whole, whatever its sample says; on-zstd / on-lz4: the
# node's settings with that codec (``compression = "zstd"`` / ``"lz4"``); on-stage: the L0
# writer process compresses each L0 it writes and the upload sends that object
# (``stage_in_l0_writer = True``; off by default, where the uploads compress every layer in
# the pageserver's own threads); on-zstd-fast: zstd at its fast level -1
# (``compression_level = -1``) instead of 1
INGEST_CONFIGS = ("off", "on", "on-uncompressed", "on-signed", "on-no-coalesce", "on-no-probe", "on-zstd", "on-lz4",
                  "on-stage", "on-zstd-fast")
_CODECS: dict[str, Compression] = {"on-uncompressed": "none", "on-zstd": "zstd", "on-lz4": "lz4",
                                   "on-zstd-fast": "zstd"}
_LEVELS: dict[str, int] = {"on-zstd-fast": -1}
_SENT = "pageserver_remote_upload_stored_bytes_total"
_LAYER_BYTES = "pageserver_remote_upload_bytes_total"
_CODEC_CPU = "pageserver_remote_codec_cpu_seconds_total"
_LAYER_PUTS = "pageserver_remote_uploaded_layers_total"
_INDEX_PUTS = "pageserver_remote_uploaded_indexes_total"
_STAGED = "pageserver_remote_staged_layers_total"


async def _ingest_run(work: Path, mib: int, endpoint: str, config: str, pages: list[bytes],
                      pids: dict[str, int] | None = None, l0_mib: int = 256) -> dict[str, Any]:
    cfg = _storage_config(l0_mib)
    async with trio.open_nursery() as nursery:
        remote = None
        storage = None
        if config != "off":
            storage = make_remote_storage(attrs.evolve(_s3(endpoint, "bench-ingest"),
                                                       payload_signing=config == "on-signed"))
            await storage.list("nothing/")
            remote = TenantRemote(storage, 1, coalesce_indexes=config != "on-no-coalesce",
                                  compression_probe=config != "on-no-probe",
                                  stage_in_l0_writer=config == "on-stage")
            codec = _CODECS.get(config)
            if codec is not None:  # else the node's default codec
                remote = attrs.evolve(remote, compression=codec)
            if config in _LEVELS:  # else the node's default level
                remote = attrs.evolve(remote, compression_level=_LEVELS[config])
        tenant = Tenant(work, TenantId.generate(), cfg, nursery=nursery, remote=remote)
        tl = await tenant.create_timeline(TimelineId.generate())
        if tl.remote is not None:
            await tl.remote.wait_uploaded()
        cpu: dict[str, Any] = {}
        sent0, layer0 = _counter(_SENT), _counter(_LAYER_BYTES)
        codec0 = _counter(_CODEC_CPU, {"op": "compress"})
        puts0 = _counter(_LAYER_PUTS), _counter(_INDEX_PUTS)
        staged0 = _counter(_STAGED)
        seconds = await _ingest(tl, mib, pages, cpu=cpu, pids=pids)
        out: dict[str, Any] = {"config": config, "uploads": config != "off", "seconds": round(seconds, 3),
                               "mb_s": round(mib * MiB / 1e6 / seconds, 1),
                               **{k: round(v, 3) if isinstance(v, float) else v for k, v in cpu.items()}}
        if tl.remote is not None:
            t0 = time.perf_counter()
            await tl.remote.wait_uploaded()
            out["catch_up_s"] = round(time.perf_counter() - t0, 3)
            out["remote_consistent_lsn_equal"] = tl.remote_consistent_lsn == tl.disk_consistent_lsn
            out["layer_bytes"] = int(_counter(_LAYER_BYTES) - layer0)
            out["sent_bytes"] = int(_counter(_SENT) - sent0)
            out["compress_cpu_s"] = round(_counter(_CODEC_CPU, {"op": "compress"}) - codec0, 3)
            out["staged_layer_puts"] = int(_counter(_STAGED) - staged0)
            out["layer_puts"] = int(_counter(_LAYER_PUTS) - puts0[0])
            out["index_puts"] = int(_counter(_INDEX_PUTS) - puts0[1])
        await tenant.shutdown()
        if storage is not None:
            await storage.aclose()
        nursery.cancel_scope.cancel()
    shutil.rmtree(work)
    return out


def _median_cpu(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over rounds of one configuration's CPU breakdown (``bench.proc_cpu``)."""
    flat: dict[str, list[float]] = {}
    for x in runs:
        for k, v in x["cpu"].items():
            for name, val in (v.items() if isinstance(v, dict) else [("", v)]):
                flat.setdefault(f"{k}.{name}" if name else k, []).append(float(val))
    return {k: round(statistics.median(v), 3) for k, v in sorted(flat.items())}


def bench_ingest(endpoint: str, work: Path, mib: int, rounds: int, pages: list[bytes], page_source: str,
                 pids: dict[str, int] | None = None, configs: tuple[str, ...] = ("off", "on"),
                 l0_mib: int = 256) -> None:
    if configs[:1] != ("off",) or any(c not in INGEST_CONFIGS for c in configs):
        raise SystemExit(f"--ingest-configs: 'off' and any of {INGEST_CONFIGS[1:]}, got {configs}")
    runs: list[dict[str, Any]] = []
    n = len(configs)
    for r in range(rounds):  # interleaved rounds (order rotated): load changes hit all alike
        order = configs[r % n:] + configs[:r % n]
        for config in order:
            runs.append({"round": r, **trio.run(_ingest_run, work / f"ingest-{len(runs)}", mib, endpoint, config,
                                                pages, pids, l0_mib)})
    seconds = {c: {x["round"]: x["seconds"] for x in runs if x["config"] == c} for c in configs}
    med = {c: statistics.median(seconds[c].values()) for c in configs}
    out: dict[str, Any] = {"part": "ingest", "mib": mib, "l0_mib": l0_mib, "pages": page_source,
                           "distinct_pages": len(pages), "runs": runs}
    for c in configs:
        out[f"{c}_mb_s"] = round(mib * MiB / 1e6 / med[c], 1)
    for c in configs[1:]:
        per_round = [seconds["off"][r] / seconds[c][r] for r in range(rounds)]
        suffix = "" if c == "on" else "_" + c.removeprefix("on-").replace("-", "_")
        out[f"ratio_on{suffix}_vs_off_per_round"] = [round(p, 3) for p in per_round]
        out[f"ratio_on{suffix}_vs_off"] = round(statistics.median(per_round), 3)
        # the same until the uploads caught up (work left after the round counted too)
        uploaded = {x["round"]: x["seconds"] + x["catch_up_s"] for x in runs if x["config"] == c}
        until = [seconds["off"][r] / uploaded[r] for r in range(rounds)]
        out[f"ratio_on{suffix}_vs_off_until_uploaded_per_round"] = [round(p, 3) for p in until]
        out[f"ratio_on{suffix}_vs_off_until_uploaded"] = round(statistics.median(until), 3)
    for c in configs[1:]:  # bytes sent per byte of layer files (compression), over all rounds
        done = [x for x in runs if x["config"] == c]
        out[f"{c}_sent_vs_layer_bytes"] = round(sum(x["sent_bytes"] for x in done) / max(1, sum(
            x["layer_bytes"] for x in done)), 4)
        out[f"{c}_puts_per_round"] = {k: statistics.median(x[k] for x in done) for k in ("layer_puts", "index_puts")}
    for c in configs:  # where the time goes: per thread group and process, medians of the rounds
        out[f"{c}_trio_thread_cpu_s"] = statistics.median(
            x["trio_thread_cpu_s"] for x in runs if x["config"] == c)
        # the pageserver's threads, its L0 writer process and the store together: what a
        # round costs the machine
        out[f"{c}_pageserver_and_store_cpu_s"] = round(statistics.median(
            x["trio_thread_cpu_s"] + x["cpu"].get("worker_threads", {}).get("cpu_s", 0.0)
            + x["cpu"].get("l0_worker_cpu_s", 0.0)
            + x["cpu"].get("seaweedfs_cpu_s", 0.0) for x in runs if x["config"] == c), 3)
        out[f"{c}_l0_worker_cpu_s"] = round(statistics.median(
            x["cpu"].get("l0_worker_cpu_s", 0.0) for x in runs if x["config"] == c), 3)
        out[f"{c}_cpu"] = _median_cpu([x for x in runs if x["config"] == c])
    emit({**out, "goal": "ratio_on_vs_off >= 0.9 (median of per-round ratios)",
          "cpus": sorted(os.sched_getaffinity(0)), "load_avg": [round(x, 2) for x in os.getloadavg()]})


# -- attach ----------------------------------------------------------------------------------


async def _attach(endpoint: str, work: Path, mib: int, pages: list[bytes]) -> dict[str, Any]:
    # L0s of 64 MiB, then image layers over the whole keyspace at the end (no L0 -> L1 merge:
    # the images are what a steady-state tenant's reads end at)
    cfg = attrs.evolve(_storage_config(64), compaction_threshold=1000)
    storage = make_remote_storage(_s3(endpoint, "bench-attach"))
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(work / "a", tenant_id, cfg, nursery=nursery, remote=TenantRemote(storage, 1))
        tl = await tenant.create_timeline(timeline_id)
        t0 = time.perf_counter()
        await _ingest(tl, mib, pages)
        await tl.compact(force_image=True)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        build_s = time.perf_counter() - t0
        layers = list(tl.layer_map)
        layer_bytes = sum(x.file_size for x in layers)
        lsn = tl.last_record_lsn
        await tenant.shutdown()
        shutil.rmtree(work / "a")

        t0 = time.perf_counter()
        attached = await Tenant.load(work / "b", tenant_id, cfg, nursery=nursery, remote=TenantRemote(storage, 2))
        attach_s = time.perf_counter() - t0
        atl = attached.timelines[timeline_id]
        key = rel_block_key(1663, 5, 16384, 0, (mib * MiB // PAGE) // 2)
        t0 = time.perf_counter()
        await atl.get(key, lsn)
        first_s = time.perf_counter() - t0
        fetched = sum(x.file_size for x in atl.layer_map if x.resident)
        t0 = time.perf_counter()
        await atl.get(key, lsn)
        second_s = time.perf_counter() - t0
        await attached.shutdown()
        nursery.cancel_scope.cancel()
    await storage.aclose()
    return {"part": "attach", "layer_bytes": layer_bytes, "layers": len(layers), "build_and_upload_s": round(build_s, 1),
            "attach_s": round(attach_s, 3), "first_read_ms": round(first_s * 1000, 1),
            "first_read_downloaded_bytes": fetched, "second_read_ms": round(second_s * 1000, 3)}


def _cpu_list(spec: str | None) -> frozenset[int] | None:
    """``0,2-3`` -> {0, 2, 3}."""
    if spec is None:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def run(args: argparse.Namespace) -> int:
    if args.impl is not None:  # --impl native,python: the whole bench once per implementation
        return run_per_impl("bench.remote", args, "remote")
    setup_logging(level="warning")  # stdout carries the JSON lines only; warnings go to stderr
    cpus = _cpu_list(args.cpus)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # this thread; the threads started later inherit it
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="pagestore-bench-remote-", dir=args.dir))
    weed_dir = work / "seaweedfs" if args.seaweedfs_dir is None else Path(
        tempfile.mkdtemp(prefix="pagestore-bench-seaweedfs-", dir=args.seaweedfs_dir))
    server = None
    try:
        endpoint = args.endpoint
        if endpoint is None:
            server = SeaweedServer(weed_dir, volume_size_limit_mb=256, cpus=_cpu_list(args.seaweedfs_cpus))
            server.start()
            endpoint = server.endpoint
        emit({"part": "setup", "endpoint": endpoint, "seaweedfs_started": server is not None,
              "seaweedfs_dir": str(weed_dir) if server is not None else None,
              "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]})
        if "upload" in parts:
            bench_upload(endpoint, work, args.upload_mib, args.layer_mib, args.rounds)
        pages: list[bytes] = []
        if "ingest" in parts or "attach" in parts:
            pages = pgbench_pages(args.ingest_pgbench_scale) if args.ingest_pages == "pgbench" else random_pages()
        if "ingest" in parts:
            pids = {} if server is None or server.proc is None else {"seaweedfs": server.proc.pid}
            for l0_mib in (int(x) for x in args.ingest_l0_mib.split(",")):
                bench_ingest(endpoint, work, args.ingest_mib, args.rounds, pages, args.ingest_pages, pids,
                             tuple(args.ingest_configs.split(",")), l0_mib)
        if "attach" in parts:
            emit({**trio.run(_attach, endpoint, work, args.attach_mib, pages), "pages": args.ingest_pages})
    finally:
        if server is not None:
            server.stop(grace_s=2.0)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(weed_dir, ignore_errors=True)
    return 0


