"""CRC-32C (Castagnoli) through the ``crc32c`` package, imported on first use.

The ``crc32c`` package's ``__init__`` pulls in its command-line helper and
``importlib.metadata``, which import ``socket`` and ``selectors``. protocol/ must not load
IO-capable modules just by being imported (tests/protocol/test_sans_io.py), so the package
is loaded the first time a checksum is computed. Call it as ``crc.crc32c(data, value)``
(module attribute lookup), so every caller gets the fast function once it is bound.
"""

from __future__ import annotations


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (the previous call's result)."""
    from crc32c import crc32c as fast  # see the module docstring

    # Later calls through the module attribute go straight to the C function.
    globals()["crc32c"] = fast
    return int(fast(data, value))
