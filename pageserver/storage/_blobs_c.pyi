"""Types of the compiled blob gather (pageserver/storage/_blobs_c.pyx); the reference is
pageserver/storage/_blobs_py.py."""

from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = ["IMPL", "BlobChecksumError", "BlobOutsideRead", "ShortRead", "gather_blobs"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
TAG_IMAGE: Final[int]

class ShortRead(ValueError): ...
class BlobOutsideRead(ValueError): ...
class BlobChecksumError(ValueError): ...

def gather_blobs(
    reads: Sequence[tuple[Any, int, int, int, int]],
    blobs: Sequence[tuple[int, int, int]],
    fd_of: Callable[[Any], int],
    probe: bool,
) -> tuple[list[bytes], bytes, int, bool, int]: ...
