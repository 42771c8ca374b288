"""The pageserver's WAL ingest kernel: compiled (``protocol/_ingest_c.pyx``) or the pure-Python
twin (``protocol/_ingest_py.py``), as ``protocol._native`` selects (``PAGESTORE_PURE_PYTHON``).

- ``same_run(buf, o, pos, tot_len, stride, k, vm_at)``: the fused ingest's run of like records
  after a checked one on a WAL page (``pageserver.walingest``; contract in
  ``protocol/_ingest_py.py``): how many in a row match it, chain to it and have right CRCs,
  and their raw bytes.
- ``fused_walk(...)``: the fused ingest's walk over a whole received piece of WAL, across pages:
  every record of the fused kind until one is not, as ``Timeline.put_mixed_nowait`` items
  (packed runs of one block's values, and the fork's new size where it grows).
- ``append_triples(...)``: the in-memory layer's index entries of a packed run's values.
"""

from __future__ import annotations

from protocol import _native

__all__ = ["IMPL", "WALK_INPUT", "WALK_OTHER", "WALK_REL", "append_triples", "fused_walk", "same_run"]

_native.require("protocol._ingest_c")  # the loud ImportError, the stale-build check
if _native.IMPL == "python":
    from protocol._ingest_py import (
        IMPL,
        WALK_INPUT,
        WALK_OTHER,
        WALK_REL,
        append_triples,
        fused_walk,
        same_run,
    )
else:
    from protocol._ingest_c import (
        IMPL,
        WALK_INPUT,
        WALK_OTHER,
        WALK_REL,
        append_triples,
        fused_walk,
        same_run,
    )
