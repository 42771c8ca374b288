"""Types of the compiled pagestream batch codec (protocol/_pagestream_c.pyx); the reference is
protocol/_pagestream_py.py."""

from collections.abc import Callable, Sequence
from typing import Any, Final

from typing_extensions import Buffer

__all__ = ["IMPL", "MAX_CACHED_RELS", "decode_getpages", "encode_getpage_responses"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
BLCKSZ: Final[int]
MAX_CACHED_RELS: Final[int]

def decode_getpages(
    buf: Buffer,
    pos: int,
    end: int,
    v3: bool,
    limit: int,
    make_request: Callable[..., Any],
    make_rel: Callable[..., Any],
    rels: dict[tuple[int, int, int, int], Any],
) -> tuple[list[Any], int]: ...
def encode_getpage_responses(
    out: bytearray, v3: bool, requests: Sequence[Any], pages: Sequence[Buffer | None]
) -> None: ...
