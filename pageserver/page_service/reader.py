"""What the page service needs from a timeline, and the errors it understands.

The page service does not import the storage engine. It talks to a ``PageReader`` (a
``typing.Protocol``); ``pageserver/page_service/timeline_adapter.py`` fits the real timeline to
it and the tests use a small in-memory fake. A ``TimelineResolver`` maps each request to the
reader that serves it (one timeline per connection today; a sharded tenant would route by key),
which is why "batches never mix timelines" is a rule of the batcher.

Errors come in two kinds (protocols.md §2.3):
- ``PageRequestError``: one request failed; it is answered with a pagestream Error response
  carrying ``str(error)`` ("Bad request: ...", "Not found: ...", "LSN timeout: ...",
  "Read error: ...") and the stream goes on;
- ``StreamEndingError``: the stream ends with a libpq ErrorResponse carrying ``sqlstate``
  (``Reconnect`` 08006, ``Shutdown`` 57P01).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple, Protocol

import attrs

from protocol.lsn import Lsn
from protocol.pagestream import RelTag as RelTag
from protocol.pagestream import Request, SlruKind


class PageRequestError(Exception):
    """One request failed; the client gets a pagestream Error response, the stream goes on."""

    kind: ClassVar[str] = "Read error"

    def __str__(self) -> str:
        detail = super().__str__()
        return f"{self.kind}: {detail}" if detail else self.kind


class BadRequest(PageRequestError):
    kind = "Bad request"


class NotFound(PageRequestError):
    kind = "Not found"


class LsnTimeout(PageRequestError):
    kind = "LSN timeout"


class ReadError(PageRequestError):
    """Page reconstruction failed (missing history, a record without redo, IO error...)."""

    kind = "Read error"


class StreamEndingError(Exception):
    """Ends the pagestream with a libpq ErrorResponse carrying ``sqlstate``."""

    sqlstate: ClassVar[str] = "XX000"
    default_message: ClassVar[str] = "internal error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)


class Reconnect(StreamEndingError):
    """The client must reconnect (misrouted request, WAL wait in a bad state)."""

    sqlstate = "08006"
    default_message = "reconnect"


class Shutdown(StreamEndingError):
    """The pageserver or the timeline is shutting down."""

    sqlstate = "57P01"
    default_message = "shutdown"


class PageRead(NamedTuple):
    """One page to read at one LSN; a batch of these is one vectored read.

    A named tuple (one is made per GetPage): a frozen attrs class costs several times more to
    build."""

    rel: RelTag
    blkno: int
    lsn: Lsn


class PageReader(Protocol):
    """The timeline as the page service sees it.

    LSN arguments are effective LSNs (protocols.md §1.4), already validated against
    ``gc_cutoff_lsn`` and waited for. Methods raise ``PageRequestError`` subclasses for
    per-request failures and ``Shutdown`` when the timeline is going away.
    """

    @property
    def last_record_lsn(self) -> Lsn: ...

    @property
    def gc_cutoff_lsn(self) -> Lsn: ...

    async def wait_lsn(self, lsn: Lsn, timeout_s: float) -> None:
        """Return once WAL up to ``lsn`` is ingested; ``LsnTimeout`` after ``timeout_s``."""
        ...

    async def get_rel_exists(self, rel: RelTag, lsn: Lsn) -> bool: ...

    async def get_rel_size(self, rel: RelTag, lsn: Lsn) -> int:
        """Blocks in the fork; 0 for a missing FSM/VM fork, ``NotFound`` for a missing main."""
        ...

    async def get_db_size(self, dbnode: int, lsn: Lsn) -> int:
        """Bytes in all relations of ``dbnode`` in the default tablespace."""
        ...

    async def get_slru_segment(self, kind: SlruKind, segno: int, lsn: Lsn) -> bytes: ...

    async def get_pages(self, reads: Sequence[PageRead]) -> list[bytes | PageRequestError]:
        """One vectored read for the whole batch; one result per read, in order.

        A page at or beyond the relation's size is all zeros.
        """
        ...

    async def get_page(self, read: PageRead) -> bytes | PageRequestError:
        """``get_pages([read])[0]``, the same answer and errors: a lone request's read (a
        batch of one), which an implementation may serve without a batch's set-up."""
        ...

    async def wait_shutdown(self) -> None:
        """Return when the timeline starts shutting down (streams must end with 57P01)."""
        ...


class TimelineResolver(Protocol):
    """Maps a request to the timeline that serves it; raise ``NotFound`` or ``Reconnect``."""

    def resolve(self, request: Request) -> PageReader: ...


@attrs.frozen
class SingleTimeline:
    """The common case: every request on the connection goes to one timeline."""

    reader: PageReader

    def resolve(self, request: Request) -> PageReader:
        return self.reader

    @property
    def constant(self) -> PageReader:
        """The reader every request resolves to (the pipeline then resolves a burst once;
        a resolver without this attribute, or answering None, is asked per request)."""
        return self.reader
