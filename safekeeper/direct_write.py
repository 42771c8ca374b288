"""The staged ``O_DIRECT`` write kernel the process runs: ``_direct_write_c`` (compiled) or,
with ``PAGESTORE_PURE_PYTHON=1``, its twin ``_direct_write_py`` (protocol/_native.py decides,
loudly). The contract is in safekeeper/_direct_write_py.py."""

from __future__ import annotations

from protocol import _native

__all__ = ["ALIGN", "IMPL", "write_staged"]

_native.require("safekeeper._direct_write_c")  # the loud ImportError, the stale-build check
# mypy checks the functions of both branches against each other.
if _native.IMPL == "python":
    from safekeeper._direct_write_py import ALIGN, IMPL, write_staged
else:
    from safekeeper._direct_write_c import ALIGN, IMPL, write_staged
