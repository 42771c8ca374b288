"""``bench getpage --interleave``: configurations alternate order round by round (A B, B A, ...)
and the ``paired`` lines are each configuration over the first one, round by round; and
``--server-rev`` refuses what is not a commit. The measuring itself is replaced by a stub that
records the order (the real rows are ``test_page_service_floor``'s subprocess run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import getpage


def _args(**over: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    getpage.configure(parser)
    args = parser.parse_args([])
    for key, value in over.items():
        setattr(args, key, value)
    return args


def _run_stubbed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                 args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]]]:
    order: list[str] = []
    # per (mode, round): latency, so every ratio is known
    latency = {("serial", 0): 100.0, ("pipelined-32", 0): 110.0, ("serial", 1): 200.0,
               ("pipelined-32", 1): 180.0, ("serial", 2): 100.0, ("pipelined-32", 2): 103.0,
               ("serial", 3): 50.0, ("pipelined-32", 3): 60.0}
    rounds: dict[str, int] = {}

    async def fake_build(workdir: Path, tenants: int, pages: int) -> list[tuple[str, str]]:
        return [("t", "l")]

    def fake_run_config(workdir: Path, targets: Any, a: argparse.Namespace, mode: str,
                        get_impl: str, cache: str, qd: int, security: str = "off") -> dict[str, Any]:
        n = rounds[mode] = rounds.get(mode, -1) + 1
        order.append(mode)
        lat = latency[(mode, n)]
        return {"target": "pagestore", "mode": mode, "queue_depth": qd, "clients_per_tenant": a.clients,
                "tenants": 1, "get_impl": get_impl, "cache": cache, "pages_per_s": round(1e6 / lat),
                "latency_mean_us": lat, "latency_p50_us": lat, "server_cpu_us_per_request": lat / 2}

    monkeypatch.setattr(getpage, "_build", fake_build)
    monkeypatch.setattr(getpage, "_run_config", fake_run_config)
    assert getpage.run(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return order, lines


def test_interleave_alternates_the_order_and_pairs_rounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(rounds=4, modes="serial,pipelined-32", queue_depth="1", interleave=True)
    order, lines = _run_stubbed(monkeypatch, capsys, args)
    assert order == ["serial", "pipelined-32", "pipelined-32", "serial"] * 2
    (paired,) = [line for line in lines if "paired" in line]
    assert paired["paired"] == "pipelined-32 vs serial"
    assert paired["rounds"] == 4 and len(paired["load_1m"]) == 4
    mean = paired["latency_mean_us_ratio"]
    assert mean["rounds"] == [1.1, 0.9, 1.03, 1.2]
    assert mean["median"] == pytest.approx(1.065) and mean["min"] == 0.9 and mean["max"] == 1.2
    assert paired["server_cpu_us_per_request_ratio"]["rounds"] == [1.1, 0.9, 1.03, 1.2]


def test_without_interleave_the_order_is_fixed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(rounds=2, modes="serial,pipelined-32", queue_depth="1")
    order, lines = _run_stubbed(monkeypatch, capsys, args)
    assert order == ["serial", "pipelined-32"] * 2
    assert not [line for line in lines if "paired" in line]
    medians = [line for line in lines if line.get("summary")]
    assert all(len(m["load_1m_rounds"]) == 2 for m in medians)


def test_server_rev_refuses_what_is_not_a_commit(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a commit"):
        getpage._export_rev("no-such-revision-here", tmp_path)
