"""free_port(): distinct, bindable ports below the ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from common import ports
from common.ports import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(20000 <= p < 32000 for p in picked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Narrow the range to two ports and occupy one: only the other may come back.
    with socket.socket() as held:
        for base in range(30000, 31990, 2):
            try:
                held.bind(("127.0.0.1", base))
            except OSError:
                continue
            break
        monkeypatch.setattr(ports, "_PORT_RANGE", (base, base + 2))
        monkeypatch.setattr(ports, "_HANDED_OUT", set())
        try:
            got = ports.free_port()
        except OSError:
            return  # base + 1 was busy too: nothing else could have been handed out
        assert got == base + 1
