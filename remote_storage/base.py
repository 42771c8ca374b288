"""The ``RemoteStorage`` interface every backend implements, and its values.

Keys are ``/``-separated strings relative to the backend's root (a local directory, or a
bucket and prefix). Objects are immutable once written as far as the callers are concerned:
pagestore never overwrites a key with different content (generations make every key unique).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs


@attrs.frozen
class Listing:
    keys: list[str]  # objects under the prefix (or directly under it, with a delimiter)
    prefixes: list[str]  # with a delimiter: the "sub-directories", each ending in it


class RemoteStorage(Protocol):
    async def upload(self, key: str, data: bytes) -> None: ...

    async def upload_file(self, key: str, path: Path) -> int:
        """Upload the file at ``path`` (read in a worker thread); returns its size."""
        ...

    async def download(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (``end`` None: to its end)."""
        ...

    async def download_file(self, key: str, path: Path) -> int:
        """The whole object written to ``path`` (created or truncated); returns its size."""
        ...

    async def list(self, prefix: str, delimiter: str | None = None) -> Listing: ...

    async def delete(self, key: str) -> None: ...

    async def delete_objects(self, keys: Sequence[str]) -> None: ...

    async def aclose(self) -> None: ...
