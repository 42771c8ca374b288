"""The layer-planning kernel the process runs: ``_plan_c`` (compiled) or, with
``PAGESTORE_PURE_PYTHON=1``, its twin ``_plan_py`` (protocol/_native.py decides, loudly)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import _native

__all__ = ["EntryOutsideData", "plan_cached"]

_native.require("pageserver.storage._plan_c")  # the loud ImportError, the stale-build check
if _native.IMPL == "python":
    from pageserver.storage._plan_py import plan_cached
else:
    from pageserver.storage._plan_c import plan_cached
if TYPE_CHECKING:
    from pageserver.storage._plan_c import EntryOutsideData
elif _native.IMPL == "python":
    from pageserver.storage._plan_py import EntryOutsideData
else:
    from pageserver.storage._plan_c import EntryOutsideData
