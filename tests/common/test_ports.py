"""free_port(): distinct, bindable ports below the ephemeral range, never handed out twice."""

from __future__ import annotations

import itertools
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
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the whole (narrowed) range
        try:
            got = ports.free_port()
        except OSError:
            return  # base + 1 was busy too: nothing else could have been handed out
        assert got == base + 1


def test_xdist_workers_pick_from_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for n in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        slices.append(ports.port_range())
        low, high = slices[-1]
        assert all(low <= free_port() < high for _ in range(20))
    assert slices[0][0] == 20000 and slices[-1][1] <= 32000
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(slices))
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert ports.port_range() == (20000, 32000)
