"""Types of the compiled GetPage load generator (protocol/_getpage_load_c.pyx); the reference
is protocol/_getpage_load_py.py."""

from array import array
from collections.abc import Sequence
from typing import Final, overload

from typing_extensions import Buffer, disjoint_base

__all__ = ["IMPL", "MAX_RELS", "GetPageLoad", "LoadProtocolError", "LoadServerError"]

IMPL: Final = "native"
SOURCE_HASH: Final[str]
MAX_LSN: Final[int]
MAX_MESSAGE_LEN: Final[int]
BLCKSZ: Final[int]
MAX_RELS: Final[int]

class LoadProtocolError(ValueError): ...
class LoadServerError(RuntimeError): ...

@disjoint_base
class GetPageLoad:
    @property
    def pages(self) -> int: ...
    @overload
    def __init__(
        self, rel: tuple[int, int, int, int], pages: int, seed: int, first_reqid: int = 1
    ) -> None: ...
    @overload
    def __init__(
        self,
        rel: Sequence[tuple[int, int, int, int]],
        pages: Sequence[int],
        seed: int,
        first_reqid: int = 1,
    ) -> None: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def count(self) -> int: ...
    def latencies_us(self) -> array[int]: ...
    def requests(self, n: int, now_ns: int) -> bytes: ...
    def feed(self, data: Buffer, now_ns: int, resend: bool) -> bytes: ...
