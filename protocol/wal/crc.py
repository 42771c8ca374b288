"""CRC-32C (Castagnoli) for every WAL record, page and file checksum pagestore computes.

``crc32c(data, value=0)`` continues from ``value`` (the previous call's result). It is the
selected kernel's function (``protocol.wal.kernels``: SSE4.2 or a table fallback in the
compiled module, the ``crc32c`` package in the pure-Python twin), bound once at import.
"""

from __future__ import annotations

from protocol.wal.kernels import crc32c

__all__ = ["crc32c"]
