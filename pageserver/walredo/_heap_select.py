"""The heap placement kernel the process runs: ``_heap_c`` (compiled) or, with
``PAGESTORE_PURE_PYTHON=1``, its twin ``_heap_py`` (protocol/_native.py decides, loudly)."""

from __future__ import annotations

from protocol import _native

__all__ = ["IMPL", "multi_insert", "put_tuple"]

_native.require("pageserver.walredo._heap_c")  # the loud ImportError, the stale-build check
# mypy checks the functions of both branches against each other (same signatures)
if _native.IMPL == "python":
    from pageserver.walredo._heap_py import IMPL, multi_insert, put_tuple
else:
    from pageserver.walredo._heap_c import IMPL, multi_insert, put_tuple
