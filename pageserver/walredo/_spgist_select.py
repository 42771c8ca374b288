"""The SP-GiST tuple kernel the process runs: ``_spgist_c`` (compiled) or, with
``PAGESTORE_PURE_PYTHON=1``, its twin ``_spgist_py`` (protocol/_native.py decides, loudly)."""

from __future__ import annotations

from protocol import _native

__all__ = ["multi_delete", "place_leaves", "skip_leaves"]

_native.require("pageserver.walredo._spgist_c")  # the loud ImportError, the stale-build check
# mypy checks the functions of both branches against each other
if _native.IMPL == "python":
    from pageserver.walredo._spgist_py import multi_delete, place_leaves, skip_leaves
else:
    from pageserver.walredo._spgist_c import multi_delete, place_leaves, skip_leaves
