"""Where the CPU of a measured interval goes, from ``/proc``: per thread of this process (the
trio thread, trio's worker threads, the rest), per other process (e.g. a SeaweedFS server the
benchmark started), and the whole machine (what the neighbours used). Also each thread's
voluntary and involuntary context switches: a thread that waits for the GIL or a lock sleeps
(voluntary), one that waits for a core is preempted (involuntary).

``Sample.take(pids)`` before and after; ``breakdown(before, after)`` gives the differences as
a JSON-ready dict. Threads that end between the two samples are not counted (trio keeps its
worker threads for a while, so a benchmark's uploads and flushes are). Linux only (reads ``/proc``); elsewhere the samples are empty.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import attrs

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@attrs.frozen
class ThreadTimes:
    name: str
    cpu_s: float
    voluntary: int
    involuntary: int


def _stat_cpu(stat: str) -> float:
    # fields after the ")" of the command name: state is field 3; utime, stime are 14, 15
    rest = stat[stat.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _TICK


def _switches(status: str) -> tuple[int, int]:
    vol = invol = 0
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            invol = int(line.split()[1])
    return vol, invol


def _threads() -> dict[int, ThreadTimes]:
    out: dict[int, ThreadTimes] = {}
    root = Path("/proc/self/task")
    if not root.exists():
        return out
    for task in root.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            cpu = _stat_cpu((task / "stat").read_text())
            vol, invol = _switches((task / "status").read_text())
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        out[int(task.name)] = ThreadTimes(name, cpu, vol, invol)
    return out


def process_cpu(pid: int) -> float | None:
    """The CPU seconds (user and system) process ``pid`` has used; None if it is gone."""
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def _machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])
    return (total - idle) / _TICK, total / _TICK


@attrs.frozen
class Sample:
    threads: dict[int, ThreadTimes]
    processes: dict[str, float | None]
    machine_busy_s: float
    machine_total_s: float

    @classmethod
    def take(cls, pids: dict[str, int] | None = None) -> Sample:
        busy, total = _machine()
        return cls(_threads(), {name: process_cpu(pid) for name, pid in (pids or {}).items()}, busy, total)


def _group(tid: int, main_tid: int) -> str:
    # trio names its worker threads after the job they run, so the name does not tell an
    # upload from a flush: the trio thread, and the rest
    return "trio_thread" if tid == main_tid else "worker_threads"


def breakdown(before: Sample, after: Sample, *, main_tid: int | None = None) -> dict[str, Any]:
    """CPU seconds and context switches between two samples, per group of threads (the trio
    thread is ``main_tid``, default the main thread), per named process, and the machine's
    busy seconds with those of this process and the named processes taken out
    (``neighbours_cpu_s``: other programs on the machine)."""
    main = main_tid if main_tid is not None else threading.main_thread().native_id
    groups: dict[str, dict[str, float]] = {}
    workers = 0
    for tid, t in after.threads.items():
        b = before.threads.get(tid, ThreadTimes(t.name, 0.0, 0, 0))
        g = _group(tid, main or 0)
        acc = groups.setdefault(g, {"cpu_s": 0.0, "voluntary_switches": 0, "involuntary_switches": 0})
        acc["cpu_s"] += t.cpu_s - b.cpu_s
        acc["voluntary_switches"] += t.voluntary - b.voluntary
        acc["involuntary_switches"] += t.involuntary - b.involuntary
        if g == "worker_threads" and t.cpu_s - b.cpu_s > 0:
            workers += 1
    out: dict[str, Any] = {g: {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}
                           for g, d in sorted(groups.items())}
    out["busy_worker_threads"] = workers
    ours = sum(d["cpu_s"] for d in groups.values())
    others = 0.0
    for name, cpu in after.processes.items():
        cpu0 = before.processes.get(name)
        if cpu is not None and cpu0 is not None:
            out[f"{name}_cpu_s"] = round(cpu - cpu0, 3)
            others += cpu - cpu0
    busy = after.machine_busy_s - before.machine_busy_s
    out["machine_busy_cpu_s"] = round(busy, 3)
    out["machine_cpu_s"] = round(after.machine_total_s - before.machine_total_s, 3)
    out["neighbours_cpu_s"] = round(max(0.0, busy - ours - others), 3)
    return out
