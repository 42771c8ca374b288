"""Stub of the compiled image fast path (twin: pageserver/storage/_images_py.py)."""

from collections.abc import MutableMapping, Sequence
from typing import Any, Final

__all__ = ["BLCKSZ", "IMPL", "MAX_RUN", "read_images", "read_images_into"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
BLCKSZ: Final[int]
MAX_RUN: Final[int]

def read_images(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    cont: int,
    floor: int,
    data_start: int,
    data_end: int,
    fd: int,
) -> tuple[list[bytes | None], bytes, int, int, int, bool]: ...

def read_images_into(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    cont: int,
    floor: int,
    data_start: int,
    data_end: int,
    fd: int,
    out: bytearray,
    dest: int,
    stride: int,
    slots: Sequence[int],
) -> tuple[bytes, bytes, int, int, int, bool]: ...
