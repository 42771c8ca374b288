"""The pageserver's WAL ingest kernel: compiled (``protocol/_ingest_c.pyx``) or the pure-Python
twin (``protocol/_ingest_py.py``), as ``protocol._native`` selects (``PAGESTORE_PURE_PYTHON``).

- ``same_run(buf, o, pos, tot_len, stride, k, vm_at)``: the fused ingest's run of like records
  after a checked one on a WAL page (``pageserver.walingest``; contract in
  ``protocol/_ingest_py.py``): how many in a row match it, chain to it and have right CRCs,
  and their raw bytes.
"""

from __future__ import annotations

from protocol import _native

__all__ = ["IMPL", "same_run"]

_native.require("protocol._ingest_c")  # the loud ImportError, the stale-build check
if _native.IMPL == "python":
    from protocol._ingest_py import IMPL, same_run
else:
    from protocol._ingest_c import IMPL, same_run
