"""Types of the compiled ingest kernel (protocol/_ingest_c.pyx); the reference is protocol/_ingest_py.py."""

from array import array
from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

__all__ = ["IMPL", "WALK_INPUT", "WALK_OTHER", "WALK_REL", "append_triples", "fused_walk", "same_run"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
_WalkItem = tuple[bytes, array[int], bytes, int, int, bool] | tuple[bytes, int, bytes, bool]
WALK_INPUT: Final = 0
WALK_OTHER: Final = 1
WALK_REL: Final = 2

def same_run(
    buf: Buffer, o: int, pos: int, tot_len: int, stride: int, k: int, vm_at: int
) -> tuple[int, tuple[bytes, ...]]: ...

def fused_walk(
    buf: Buffer, base: int, pos: int, prev: int, latest_page: int, tli: int, seg_size: int,
    rels: Sequence[tuple[int, int, int, int, int]], nxt: int, last: int,
) -> tuple[int, int, int, int, list[_WalkItem], tuple[int, ...], int, tuple[int, int, int, int] | None]: ...
def append_triples(
    entries: array[int], ends: array[int], start: int, stop: int, offset: int, vlen: int, will_init: bool
) -> None: ...
