"""Types of the compiled ingest kernel (protocol/_ingest_c.pyx); the reference is protocol/_ingest_py.py."""

from typing import Final

from typing_extensions import Buffer

__all__ = ["IMPL", "same_run"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]

def same_run(
    buf: Buffer, o: int, pos: int, tot_len: int, stride: int, k: int, vm_at: int
) -> tuple[int, tuple[bytes, ...]]: ...
