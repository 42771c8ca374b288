"""``bench.impl_rows``: ``--impl native,python`` runs a bench once per implementation, each pass
in a child process on those kernels, every JSON line tagged with the implementation that made it."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.impl_rows import parse_impls, run_per_impl

pytestmark = pytest.mark.native


def test_one_pass_per_implementation_each_on_its_kernels(capfd: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(x=7, impl="native,python")
    assert run_per_impl("tests.common.impl_probe", args, "probe") == 0
    out = capfd.readouterr().out.splitlines()
    rows = [json.loads(line) for line in out if line.startswith("{")]
    described = [r for r in rows if r.get("part") == "impl"]
    probes = [r for r in rows if "loaded" in r]
    assert [r["impl"] for r in described] == ["native", "python"]
    assert [(r["impl"], r["loaded"], r["env"]) for r in probes] == [("native", "native", None),
                                                                   ("python", "python", "1")]
    assert all(r["x"] == 7 and r["impl_arg"] is None for r in probes)
    assert out.count("a line that is not JSON") == 2


def test_unknown_implementations_are_refused() -> None:
    for bad in ("", "native,cython", "pypy"):
        with pytest.raises(SystemExit):
            parse_impls(bad)
    assert parse_impls("python, native") == ["python", "native"]
