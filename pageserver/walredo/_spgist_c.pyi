"""Types of the compiled SP-GiST tuple kernel (pageserver/walredo/_spgist_c.pyx); the reference
is pageserver/walredo/_spgist_py.py."""

from typing import Final

from typing_extensions import Buffer

__all__ = ["IMPL", "multi_delete", "place_leaves", "skip_leaves"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]

def skip_leaves(data: Buffer, at: int, n: int) -> int: ...
def place_leaves(page: bytearray, data: Buffer, offsets_at: int, select_at: int, tuples_at: int, n: int, want: int) -> int: ...
def multi_delete(
    page: bytearray,
    data: Buffer,
    offsets_at: int,
    n: int,
    first_state: int,
    rest_state: int,
    blkno: int,
    offnum: int,
    xid: int,
) -> None: ...
