"""Types of the compiled WAL kernels (protocol/_wal_c.pyx); the reference is protocol/_wal_py.py."""

from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer, disjoint_base

from protocol.lsn import Lsn
from protocol.wal.errors import InvalidWal

__all__ = ["IMPL", "RecordTracker", "crc32c", "crc32c_kernel", "scan_records"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]

def crc32c_kernel() -> str: ...
def crc32c(data: Buffer, value: int = 0) -> int: ...
def scan_records(buf: Buffer, i: int, n: int, base: int, seg_size: int) -> tuple[int, int, int]: ...

@disjoint_base
class RecordTracker:
    pos: Lsn
    record_end: Lsn
    @property
    def seg_size(self) -> int: ...
    def __init__(self, start_lsn: Lsn, seg_size: int = 16777216) -> None: ...
    def feed(self, data: Buffer) -> Lsn: ...
    def feed_many(self, chunks: Sequence[Buffer]) -> tuple[int, Lsn, InvalidWal | None]: ...
