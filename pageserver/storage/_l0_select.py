"""The L0 packing kernel the process runs: ``_l0_c`` (compiled) or, with
``PAGESTORE_PURE_PYTHON=1``, its twin ``_l0_py`` (protocol/_native.py decides, loudly)."""

from __future__ import annotations

from protocol import _native

__all__ = ["pack_values"]

_native.require("pageserver.storage._l0_c")  # the loud ImportError, the stale-build check
if _native.IMPL == "python":
    from pageserver.storage._l0_py import pack_values
else:
    from pageserver.storage._l0_c import pack_values
