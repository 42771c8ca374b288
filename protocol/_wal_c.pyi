"""Types of the compiled WAL kernels (protocol/_wal_c.pyx); the reference is protocol/_wal_py.py."""

from typing import Final

from typing_extensions import Buffer

__all__ = ["IMPL", "crc32c", "crc32c_kernel", "scan_records"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]

def crc32c_kernel() -> str: ...
def crc32c(data: Buffer, value: int = 0) -> int: ...
def scan_records(buf: Buffer, i: int, n: int, base: int, seg_size: int) -> tuple[int, int, int]: ...
