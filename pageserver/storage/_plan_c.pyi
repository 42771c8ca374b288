"""Types of the compiled layer planning (pageserver/storage/_plan_c.pyx); the reference is
pageserver/storage/_plan_py.py."""

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Final

__all__ = ["ENTRY_SIZE", "IMPL", "EntryOutsideData", "plan_cached"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
ENTRY_SIZE: Final[int]

class EntryOutsideData(ValueError): ...

def plan_cached(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    floor: int,
    cont: int,
    states: Mapping[Any, Any],
    blobs: list[tuple[int, int, int]],
    reads: list[tuple[Any, int, int, int, int]],
    reader: object,
    max_bytes: int,
    data_start: int,
    data_end: int,
) -> tuple[int, int] | None: ...
