"""The WAL kernels pagestore runs: compiled (``protocol/_wal_c.pyx``) or the pure-Python
twin (``protocol/_wal_py.py``), as ``protocol._native`` selects (``PAGESTORE_PURE_PYTHON``).

- ``crc32c(data, value=0)``: CRC-32C, chained (``crc32c(b, crc32c(a)) == crc32c(a + b)``).
- ``crc32c_kernel()``: which CRC kernel runs (``"sse4.2"``, ``"table"``, ...).
- ``scan_records(buf, i, n, base, seg_size)``: complete records of a WAL buffer, CRCs checked
  (the record tracker's fast path; contract in ``protocol/_wal_py.py``).
- ``RecordTracker(start_lsn, seg_size)``: the safekeeper's streaming record-boundary finder
  (contract in ``safekeeper/record_tracker.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import _native

__all__ = ["IMPL", "RecordTracker", "crc32c", "crc32c_kernel", "scan_records"]

_native.require("protocol._wal_c")  # the loud ImportError, the stale-build check
# mypy checks the functions of both branches against each other; the two RecordTracker
# classes are distinct types, so users see the compiled one's stub.
if _native.IMPL == "python":
    from protocol._wal_py import IMPL, crc32c, crc32c_kernel, scan_records
else:
    from protocol._wal_c import IMPL, crc32c, crc32c_kernel, scan_records
if TYPE_CHECKING:
    from protocol._wal_c import RecordTracker
elif _native.IMPL == "python":
    from protocol._wal_py import RecordTracker
else:
    from protocol._wal_c import RecordTracker
