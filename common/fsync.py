"""Making files and directory entries durable: the fsync of a file before it is renamed into
place, and of a directory after a rename or unlink in it.

Every room that publishes a file by write-to-temp, fsync, rename needs these steps; one copy
here so they all do it the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path | str) -> None:
    """fsync the file ``path``: its bytes are on disk before a rename publishes it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """fsync the directory ``path``: entries renamed or removed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
