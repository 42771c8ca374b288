"""Tenant and timeline identities: 16 random bytes, written as 32 lower-case hex chars."""

from __future__ import annotations

import secrets
from typing import Self

import attrs

from protocol.errors import RemoteProtocolError


@attrs.frozen(order=True)
class _Id16:
    raw: bytes = attrs.field()

    @raw.validator
    def _check(self, _a: attrs.Attribute[bytes], value: bytes) -> None:
        if len(value) != 16:
            raise ValueError(f"{type(self).__name__} needs 16 bytes, got {len(value)}")

    @classmethod
    def generate(cls) -> Self:
        return cls(secrets.token_bytes(16))

    @classmethod
    def parse(cls, text: str) -> Self:
        if len(text) != 32:
            raise RemoteProtocolError(f"invalid {cls.__name__} {text!r}: expected 32 hex chars")
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise RemoteProtocolError(
                f"invalid {cls.__name__} {text!r}: expected 32 hex chars"
            ) from None

    @property
    def hex(self) -> str:
        return self.raw.hex()

    def __str__(self) -> str:
        return self.raw.hex()


class TenantId(_Id16):
    """A tenant: one customer's set of timelines."""


class TimelineId(_Id16):
    """A timeline: one branch of a tenant's database history."""
