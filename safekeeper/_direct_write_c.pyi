"""Types of the compiled O_DIRECT staged write (safekeeper/_direct_write_c.pyx); the reference
is safekeeper/_direct_write_py.py."""

from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

__all__ = ["ALIGN", "IMPL", "write_staged"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
ALIGN: Final = 4096

def write_staged(
    fd: int, stage: Buffer, head: int, chunks: Sequence[Buffer], start: int, sync: bool
) -> int: ...
