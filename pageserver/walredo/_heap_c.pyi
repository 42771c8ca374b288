"""Types of the compiled heap tuple placement (pageserver/walredo/_heap_c.pyx); the reference
is pageserver/walredo/_heap_py.py."""

from typing import Final

from typing_extensions import Buffer

__all__ = ["IMPL", "multi_insert", "put_tuple"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]

def put_tuple(
    page: bytearray,
    offnum: int,
    xmin: int,
    xmax: int,
    blkno: int,
    infomask2: int,
    infomask: int,
    hoff: int,
    body: Buffer,
) -> None: ...
def multi_insert(page: bytearray, main_data: Buffer, data: Buffer, xid: int, blkno: int, init: bool) -> int: ...
