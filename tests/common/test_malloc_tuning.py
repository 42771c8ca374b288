"""common.malloc_tuning: with the thresholds fixed, a buffer allocated and freed per batch is
reused from the heap instead of being given back and faulted in again every time.

The buffer here is 40 MiB: above glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so
with the defaults every allocation is a fresh mapping faulted in page by page; with the
thresholds set above it, the heap keeps and reuses it. (The server's own pattern, a ~260 KiB
buffer at the top of the heap trimmed and re-grown per batch, depends on the heap's layout;
this checks that the settings take effect.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

_LOOP = """
import resource, sys
from common.malloc_tuning import keep_freed_heap
if sys.argv[1] == "tuned":
    assert keep_freed_heap(trim_bytes=256 << 20, mmap_bytes=128 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):
    buf = bytearray(40 << 20)  # zero-filled: every page touched
    del buf
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip())


def test_a_freed_batch_buffer_is_reused_not_faulted_in_again() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    pages = (40 << 20) // 4096
    assert default >= 15 * pages, default  # glibc's defaults: a fresh mapping per buffer
    assert tuned <= 3 * pages, tuned  # faulted in once, then reused
