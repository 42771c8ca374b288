"""``--impl native,python`` for a bench that runs its nodes in its own process tree: the whole
bench once per implementation, each pass a child process whose environment selects the kernels
(``PAGESTORE_PURE_PYTHON=1`` for the pure-Python twins, unset for the compiled ones), so that
every process it starts (pageserver, safekeepers, page filesystem, or the bench's own in-process
nodes) runs the same implementation. The passes run one after the other in the same command;
every JSON line a pass prints gets ``"impl"`` added, and each pass first prints what the child
process actually loaded (``protocol._native.describe()``), so a row is never misattributed.

Used by ``bench compute`` and ``bench remote`` (their parts run whole clusters or in-process
nodes; per-row interleaving as ``bench getpage`` does would need each part restructured).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from protocol import _native

IMPLS = ("native", "python")


def parse_impls(text: str) -> list[str]:
    impls = [part.strip() for part in text.split(",") if part.strip()]
    if not impls or any(i not in IMPLS for i in impls):
        raise SystemExit(f"--impl: native, python or both (got {text!r})")
    return impls


def add_impl_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--impl", default=None,
        help="comma list: native (the compiled kernels), python (PAGESTORE_PURE_PYTHON=1): the "
        "whole bench once per implementation in this run, every process of a pass on the same "
        "kernels, each line tagged with impl (default: the implementation this process runs)",
    )


def run_per_impl(module: str, args: argparse.Namespace, bench: str) -> int:
    """Run ``module.run(args)`` (with ``impl`` cleared) in one child per ``args.impl``."""
    rc = 0
    for impl in parse_impls(args.impl):
        child_args = argparse.Namespace(**{**vars(args), "impl": None})
        env = {k: v for k, v in os.environ.items() if k != _native.ENV_VAR}
        if impl == "python":
            env[_native.ENV_VAR] = "1"
        with tempfile.NamedTemporaryFile(prefix="pagestore-impl-args-", suffix=".pickle") as f:
            pickle.dump(child_args, f)
            f.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.impl_rows", module, bench, f.name],
                stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parent.parent,
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("{"):
                    row = json.loads(line)
                    row.setdefault("impl", impl)
                    if row["impl"] != impl:
                        raise RuntimeError(f"a {impl} pass printed a row of {row['impl']!r}: {line}")
                    line = json.dumps(row) + "\n"
                sys.stdout.write(line)
                sys.stdout.flush()
            if proc.wait() != 0:
                rc = proc.returncode
                print(f"the {impl} pass of bench {bench} failed (exit {rc})", file=sys.stderr)
    return rc


def _child(module: str, bench: str, pickled: str) -> int:
    with open(pickled, "rb") as f:
        args = pickle.load(f)  # our own file: run_per_impl wrote it for this child
    print(json.dumps({"bench": bench, "part": "impl", **_native.describe()}), flush=True)
    return int(importlib.import_module(module).run(args))


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:4]))
