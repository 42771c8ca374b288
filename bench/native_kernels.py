"""``pagestore bench native-kernels``: each native kernel beside its pure-Python twin, one run.

Both implementations are loaded in this one process (``protocol._native.load_native`` and the
twin module) and timed on the same inputs, interleaved round by round; every row is CPU time
(``time.process_time``) so other load on the machine moves it less than wall time. JSON lines:
``{"bench": "native-kernels", "kernel": ..., "impl": "native"|"python", "mib_s": ...,
"us_per_item": ..., "rounds": [...]}`` and one ``"ratio"`` line per kernel (native over python,
median of the per-round ratios).

Kernels: ``crc32c`` (8 KiB buffers), ``tracker-1k`` / ``tracker-128k`` (``RecordTracker.feed``
over synthetic WAL of ``--record-size``-byte records in 1 KiB / 128 KiB pieces; its fast path is
``scan_records``), ``coalesce-1k`` (runs of 128 v3 AppendRequests of 1 KiB).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from protocol import _native
from protocol.lsn import Lsn
from protocol.safekeeper import AppendRequest, encode_message
from safekeeper.testing import synthetic_wal

BASE = 0x2000000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=64, help="MiB of WAL per round")
    parser.add_argument("--record-size", type=int, default=200, help="WAL record size in bytes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each times both implementations")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG: CPU throughput per kernel, native beside python")


def _modules(native_name: str) -> dict[str, ModuleType]:
    return {
        "native": _native.load_native(native_name),
        "python": importlib.import_module(native_name[:-2] + "_py"),
    }


def _cpu(fn: Callable[[], object]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def run(args: argparse.Namespace) -> int:
    wal_mods = _modules("protocol._wal_c")
    pq_mods = _modules("protocol._pq_c")
    wal = synthetic_wal(Lsn(BASE), args.mib << 20, record_size=args.record_size)
    records = len(wal) // args.record_size
    crc_buf = bytes(range(256)) * 32

    def crc(m: ModuleType) -> Callable[[], object]:
        f = m.crc32c
        return lambda: [f(crc_buf) for _ in range(len(wal) // len(crc_buf))]

    def tracker(piece: int) -> Callable[[ModuleType], Callable[[], object]]:
        def make(m: ModuleType) -> Callable[[], object]:
            view = memoryview(wal)

            def go() -> None:
                t = m.RecordTracker(Lsn(BASE))
                for at in range(0, len(view), piece):
                    t.feed(view[at : at + piece])

            return go

        return make

    appends = []
    at = BASE
    for _ in range(128):
        appends.append(memoryview(encode_message(AppendRequest(1, Lsn(at), Lsn(at + 1024), Lsn(at), Lsn(0), bytes(1024)), 3)))
        at += 1024
    runs = (args.mib << 20) // (128 * 1024)

    def coalesce(m: ModuleType) -> Callable[[], object]:
        f = m.coalesce_appends
        return lambda: [f(appends, 0, 1 << 20) for _ in range(runs)]

    kernels: list[tuple[str, dict[str, ModuleType], Callable[[ModuleType], Callable[[], object]], int, int]] = [
        ("crc32c", wal_mods, crc, (len(wal) // len(crc_buf)) * len(crc_buf), len(wal) // len(crc_buf)),
        ("tracker-1k", wal_mods, tracker(1024), len(wal), records),
        ("tracker-128k", wal_mods, tracker(128 * 1024), len(wal), records),
        ("coalesce-1k", pq_mods, coalesce, runs * 128 * 1024, runs * 128),
    ]
    rows: list[dict[str, object]] = []
    for name, mods, make, nbytes, items in kernels:
        times: dict[str, list[float]] = {impl: [] for impl in mods}
        for _ in range(max(args.rounds, 1)):
            for impl, mod in mods.items():
                times[impl].append(_cpu(make(mod)))
        for impl, ts in times.items():
            med = statistics.median(ts)
            row: dict[str, object] = {
                "bench": "native-kernels", "kernel": name, "impl": impl,
                "mib_s": round(nbytes / med / (1 << 20), 1) if med else None,
                "us_per_item": round(med / items * 1e6, 3), "cpu_s_rounds": [round(t, 4) for t in ts],
                "record_size": args.record_size,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        ratios = [p / n for n, p in zip(times["native"], times["python"], strict=True) if n > 0]
        print(json.dumps({
            "bench": "native-kernels", "kernel": name, "ratio": "python_cpu / native_cpu",
            "median": round(statistics.median(ratios), 1) if ratios else None,
        }), flush=True)
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """One group of bars per kernel: MiB of input per CPU-second, native beside python."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = list(dict.fromkeys(str(r["kernel"]) for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for k, impl in enumerate(("native", "python")):
        values = [
            next((float(r["mib_s"] or 0) for r in rows if r["kernel"] == name and r["impl"] == impl), 0.0)  # type: ignore[arg-type]
            for name in kernels
        ]
        ax.bar([x + 0.4 * k for x in range(len(kernels))], values, 0.4, label=impl)
    ax.set_xticks([x + 0.2 for x in range(len(kernels))], kernels)
    ax.set_yscale("log")
    ax.set_ylabel("MiB per CPU-second (median)")
    ax.set_title("pagestore bench native-kernels: compiled kernel vs pure-Python twin (one run)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
