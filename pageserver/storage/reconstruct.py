"""Reconstructing a value: base image + WAL records (oldest first) -> bytes, via a RedoManager.

The read paths collect, per key, an optional base image and the records above it newest-first
(``KeyState``); ``reconstruct_value`` turns that into the value's bytes. Applying records is the
``RedoManager``'s job: ``TestRedoManager`` here applies Neon-style ``Test`` records (so the
engine is testable on its own); the PostgreSQL redo (``pageserver.walredo``) plugs in through the same
Protocol and may delegate ``Test`` records to ``apply_test_records``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pageserver.storage.key import Key, key_hex
from pageserver.storage.value import Image, TestRecord, WalRecordValue
from protocol.lsn import Lsn, format_lsn


class PageReconstructError(Exception):
    """A value could not be reconstructed (per key; other keys of a batch are unaffected)."""

    def __init__(self, key: Key, lsn: int, msg: str) -> None:
        super().__init__(f"could not reconstruct key {key_hex(key)} at {format_lsn(lsn)}: {msg}")
        self.key = key
        self.lsn = lsn


class MissingKeyError(PageReconstructError):
    """The key does not exist at that LSN (no image or will_init record below it)."""


class RedoManager(Protocol):
    def apply(
        self, key: Key, base_image: bytes | None, records: list[tuple[Lsn, WalRecordValue]]
    ) -> bytes:
        """Apply ``records`` (oldest first) to ``base_image`` (None: the first record
        initializes the page). Raise ``PageReconstructError`` for what cannot be applied."""
        ...


def apply_test_records(
    key: Key, base_image: bytes | None, records: Sequence[tuple[Lsn, WalRecordValue]]
) -> bytes:
    """Neon's ``Test`` record semantics (storage.md §1.4) over UTF-8 page contents."""
    # The usual records only append: one join instead of a bytearray built up and copied out.
    parts = [base_image or b""]
    for _lsn, rec in records:
        if type(rec) is not TestRecord or rec.clear or rec.will_init or rec.only_if is not None:
            break
        parts.append(rec.append.encode())
    else:
        return b"".join(parts)
    page = bytearray(base_image or b"")
    for lsn, rec in records:
        if not isinstance(rec, TestRecord):
            raise PageReconstructError(key, lsn, f"no redo for {type(rec).__name__} here")
        if rec.will_init and (not rec.clear or page):
            raise PageReconstructError(key, lsn, "will_init Test record on a non-empty page")
        if rec.clear:
            page.clear()
        if rec.only_if is not None and bytes(page) != rec.only_if.encode():
            raise PageReconstructError(
                key, lsn, f"Test record only_if {rec.only_if!r} but page is {bytes(page)!r}"
            )
        page += rec.append.encode()
    return bytes(page)


class TestRedoManager:
    """Applies Test records only; any other record kind is a clear per-key error."""

    __test__ = False  # not a pytest test class

    def apply(
        self, key: Key, base_image: bytes | None, records: list[tuple[Lsn, WalRecordValue]]
    ) -> bytes:
        return apply_test_records(key, base_image, records)


class KeyState:
    """What a read collected for one key: records newest-first, maybe a base image.

    ``cached_lsn``/``cached_page`` seed the walk from the materialized page cache: records at
    or below ``cached_lsn`` are not needed, and the key is complete once the walk's floor drops
    to ``cached_lsn + 1`` or below (the rule PR #7477 fixed).

    The vectored walk plans from layer indexes alone and reads blobs afterwards, all at once:
    it adds *blob slots* (``add_blob``; completeness comes from the index's will_init bit) and
    decoded values in one newest-first list, which ``resolve`` turns into ``records``/``img``
    once the blobs are read.
    """

    __slots__ = ("cached_lsn", "cached_page", "complete", "img", "missing", "pending", "records")

    def __init__(self, cached_lsn: int = -1, cached_page: bytes | None = None) -> None:
        self.records: list[tuple[Lsn, WalRecordValue]] = []
        self.img: tuple[Lsn, bytes] | None = None
        self.complete = False
        self.missing = False
        self.cached_lsn = cached_lsn
        self.cached_page = cached_page
        # newest first: decoded values, or ints = slots of blobs still to be read
        self.pending: list[tuple[Lsn, Image | WalRecordValue | int]] | None = None

    def add(self, lsn: Lsn, value: Image | WalRecordValue) -> bool:
        """Take one value, newest first; completes the key at an image or will_init record.
        Returns ``complete``."""
        if self.complete:
            raise AssertionError("value added to a complete key")
        if lsn <= self.cached_lsn:
            # The walk went past the cached page: it replaces everything at or below it.
            self.complete = True
            return True
        if self.pending is not None:
            self.pending.append((lsn, value))
            self.complete = value.will_init
            return self.complete
        if isinstance(value, Image):
            self.img = (lsn, value.data)
            self.complete = True
        else:
            self.records.append((lsn, value))
            if value.will_init:
                self.complete = True
        return self.complete

    def add_blob(self, lsn: Lsn, slot: int, will_init: bool) -> bool:
        """A value still to be read (vectored walk): its place in the order is kept."""
        if self.complete or self.pending is None:
            raise AssertionError("blob added to a complete or non-deferring key")
        self.pending.append((lsn, slot))
        self.complete = will_init
        return will_init

    def resolve(self, values: Sequence[Image | WalRecordValue | bytes]) -> None:
        """Replace blob slots by the decoded values (``values[slot]``; an image may be its
        bare page bytes), fill records/img."""
        pending, self.pending = self.pending, None
        if not pending:
            return
        for lsn, item in pending:
            value = values[item] if isinstance(item, int) else item
            if isinstance(value, bytes):
                self.img = (lsn, value)
                break
            if isinstance(value, Image):
                self.img = (lsn, value.data)
                break
            self.records.append((lsn, value))
            if value.will_init:
                break

    def floor_reached(self, floor: int) -> None:
        """The walk read everything down to ``floor``: a cached page at or above it finishes."""
        if not self.complete and self.cached_lsn >= 0 and floor <= self.cached_lsn + 1:
            self.complete = True


def reconstruct_value(
    key: Key, request_lsn: int, state: KeyState, redo: RedoManager
) -> tuple[bytes, Lsn | None]:
    """The value's bytes, and the LSN to memorize it at (None: nothing was redone)."""
    if state.missing:
        raise MissingKeyError(key, request_lsn, "absent from the covering image layer")
    if not state.complete:
        raise MissingKeyError(key, request_lsn, "no image or will_init record found")
    records = state.records[::-1]
    base: bytes | None
    if state.img is not None:
        base = state.img[1]
    elif records and records[0][1].will_init:
        base = None
    elif state.cached_page is not None:
        base = state.cached_page
    else:
        raise MissingKeyError(key, request_lsn, "no image or will_init record found")
    if not records:
        assert base is not None
        return base, None
    return redo.apply(key, base, records), records[-1][0]
