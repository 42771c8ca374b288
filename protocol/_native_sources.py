"""Which compiled modules pagestore has, which source files each is built from, and their hash.

Data and one pure function only: ``setup.py`` runs this file by path (before the package is
importable) and compiles each hash into its module as ``SOURCE_HASH``; ``protocol._native``
recomputes it from the files beside the package and refuses a build whose sources changed
since (a stale ``.so`` after a ``git pull`` would otherwise run old code silently).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

# compiled module -> (its .pyx, then every header or include file it reads), relative to the
# repository root (the directory holding setup.py).
NATIVE_MODULES: Final[dict[str, tuple[str, ...]]] = {
    "protocol._wal_c": ("protocol/_wal_c.pyx", "protocol/_crc32c.h", "protocol/_bytes.h"),
    "protocol._pq_c": ("protocol/_pq_c.pyx", "protocol/_bytes.h"),
    "protocol._getpage_load_c": ("protocol/_getpage_load_c.pyx", "protocol/_bytes.h"),
    "protocol._ingest_c": ("protocol/_ingest_c.pyx", "protocol/_crc32c.h", "protocol/_bytes.h"),
    "protocol._pagestream_c": ("protocol/_pagestream_c.pyx", "protocol/_bytes.h"),
    "pageserver.storage._blobs_c": ("pageserver/storage/_blobs_c.pyx", "protocol/_crc32c.h"),
    "pageserver.walredo._spgist_c": (
        "pageserver/walredo/_spgist_c.pyx", "pageserver/walredo/_bufpage.pxd", "pageserver/walredo/_bufpage.h",
        "protocol/_bytes.h",
    ),
    "pageserver.walredo._heap_c": (
        "pageserver/walredo/_heap_c.pyx", "pageserver/walredo/_bufpage.pxd", "pageserver/walredo/_bufpage.h",
        "protocol/_bytes.h",
    ),
    "pageserver.storage._plan_c": ("pageserver/storage/_plan_c.pyx", "protocol/_bytes.h"),
    "pageserver.storage._images_c": ("pageserver/storage/_images_c.pyx", "protocol/_crc32c.h", "protocol/_bytes.h"),
    "pageserver.storage._l0_c": ("pageserver/storage/_l0_c.pyx", "protocol/_crc32c.h", "protocol/_bytes.h"),
    "safekeeper._direct_write_c": ("safekeeper/_direct_write_c.pyx",),
}

# compiled module -> its pure-Python twin (the reference).
TWINS: Final[dict[str, str]] = {name: name[: -len("_c")] + "_py" for name in NATIVE_MODULES}


def source_hash(files: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 (hex, first 32 chars) over each (relative path, content) pair, in order."""
    h = hashlib.sha256()
    for name, content in files:
        h.update(name.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
    return h.hexdigest()[:32]
