"""Types of the compiled wire kernels (protocol/_pq_c.pyx); the reference is protocol/_pq_py.py."""

from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

__all__ = ["IMPL", "coalesce_appends", "take_append_run", "take_frames"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]

def coalesce_appends(
    payloads: Sequence[Buffer], k: int, max_bytes: int
) -> tuple[int, int, int, int, int, int, int, bytes]: ...
def take_frames(
    data: Buffer, start: int, end: int, tag: int, max_length: int, limit: int
) -> tuple[list[memoryview], int]: ...
def take_append_run(
    data: Buffer, start: int, end: int, max_length: int, out: Buffer, max_bytes: int
) -> tuple[int, int, int, int, int, int, int, int]: ...
