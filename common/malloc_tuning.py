"""glibc malloc settings for a server that allocates and frees large buffers per batch.

A pagestream batch's responses are one ~260 KiB buffer (32 pages), allocated, sent and freed
per batch; the storage read allocates its preadv buffers (up to 128 KiB) per walk. With
glibc's defaults a free at the top of the heap beyond ``M_TRIM_THRESHOLD`` (128 KiB, raised
dynamically) gives the memory back to the kernel (``brk``), and the next batch takes it
again and faults every page in, zeroed: kernel time per page that depends only on where the
buffer landed in the heap. That is what made the page service's ``auth`` rows cost more than
``off`` (docs/benchmarks.md, "Auth and TLS"): its server had PyJWT, cryptography and OpenSSL
loaded and its heap laid out so that the batch buffer sat at the top; ``strace -c`` of the
two servers in steady state showed ~280 ``brk`` calls per second in the auth server and none
in the other.

``keep_freed_heap()`` fixes the thresholds (which also switches off glibc's dynamic
adjustment): freed memory up to ``trim_bytes`` stays in the process, allocations below
``mmap_bytes`` come from the heap. The cost is that a process keeps up to ``trim_bytes`` of
freed heap. Not glibc (another libc, or no ``mallopt``): returns False and changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Final

__all__ = ["keep_freed_heap"]

# <malloc.h>
M_TRIM_THRESHOLD: Final = -1
M_TOP_PAD: Final = -2
M_MMAP_THRESHOLD: Final = -3

DEFAULT_TRIM_BYTES: Final = 64 * 1024 * 1024
DEFAULT_TOP_PAD_BYTES: Final = 4 * 1024 * 1024
DEFAULT_MMAP_BYTES: Final = 32 * 1024 * 1024


def keep_freed_heap(
    trim_bytes: int = DEFAULT_TRIM_BYTES,
    top_pad_bytes: int = DEFAULT_TOP_PAD_BYTES,
    mmap_bytes: int = DEFAULT_MMAP_BYTES,
) -> bool:
    """Set glibc's trim, top-pad and mmap thresholds; True if all three were accepted."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (M_TRIM_THRESHOLD, trim_bytes),
            (M_TOP_PAD, top_pad_bytes),
            (M_MMAP_THRESHOLD, mmap_bytes),
        )
    )
