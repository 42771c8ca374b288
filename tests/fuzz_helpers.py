"""The check every ``pagestore fuzz`` target's test makes of its harness (``bench.fuzz``): its
seeds are taken when the kernel equals its twin, and a planted difference is caught on each."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from bench.fuzz import _harness, write_seeds


def harness_takes_its_seeds_and_catches(target: str, tmp_path: Path, twin: ModuleType,
                                        liar: SimpleNamespace, seeds: int) -> list[bytes]:
    """Write ``target``'s seeds into ``tmp_path`` (there must be ``seeds`` of them); the harness
    of the twin against itself takes every one, the harness of ``liar`` (kernels that answer
    otherwise than the twin) against the twin fails on every one with "differs". Returns the
    seeds' bytes for the test's own checks of them."""
    write_seeds(target, tmp_path)
    same = _harness(target, twin, twin)
    lying = _harness(target, liar, twin)  # type: ignore[arg-type]
    found = sorted(tmp_path.iterdir())
    assert len(found) == seeds, found
    out = []
    for seed in found:
        data = seed.read_bytes()
        same(data)
        with pytest.raises(AssertionError, match="differs"):
            lying(data)
        out.append(data)
    return out
