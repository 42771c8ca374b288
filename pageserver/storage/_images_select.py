"""The image fast-path kernel the process runs: ``_images_c`` (compiled) or, with
``PAGESTORE_PURE_PYTHON=1``, its twin ``_images_py`` (protocol/_native.py decides, loudly)."""

from __future__ import annotations

from protocol import _native

__all__ = ["read_images", "read_images_into"]

_native.require("pageserver.storage._images_c")  # the loud ImportError, the stale-build check
if _native.IMPL == "python":
    from pageserver.storage._images_py import read_images, read_images_into
else:
    from pageserver.storage._images_c import read_images, read_images_into
