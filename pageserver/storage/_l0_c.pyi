"""Types of the compiled L0 packing (pageserver/storage/_l0_c.pyx); the reference is
pageserver/storage/_l0_py.py."""

from array import array
from typing import Final

from typing_extensions import Buffer

__all__ = ["ENTRY_SIZE", "IMPL", "pack_values"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
ENTRY_SIZE: Final[int]

def pack_values(
    keys: Buffer,
    counts: array[int],
    triples: array[int],
    src: Buffer,
    key_at: int,
    sub: int,
    data_offset: int,
    max_bytes: int,
    lsn_start: int,
    lsn_end: int,
) -> tuple[bytes, bytes, int, int]: ...
