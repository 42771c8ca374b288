"""The blob-gather kernel the process runs: ``_blobs_c`` (compiled) or, with
``PAGESTORE_PURE_PYTHON=1``, its twin ``_blobs_py`` (protocol/_native.py decides, loudly)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import _native

__all__ = ["BlobChecksumError", "BlobOutsideRead", "ShortRead", "gather_blobs"]

_native.require("pageserver.storage._blobs_c")  # the loud ImportError, the stale-build check
# mypy checks the functions of both branches against each other; the error classes of the
# two are distinct types, so users see the compiled one's stub.
if _native.IMPL == "python":
    from pageserver.storage._blobs_py import gather_blobs
else:
    from pageserver.storage._blobs_c import gather_blobs
if TYPE_CHECKING:
    from pageserver.storage._blobs_c import BlobChecksumError, BlobOutsideRead, ShortRead
elif _native.IMPL == "python":
    from pageserver.storage._blobs_py import BlobChecksumError, BlobOutsideRead, ShortRead
else:
    from pageserver.storage._blobs_c import BlobChecksumError, BlobOutsideRead, ShortRead
