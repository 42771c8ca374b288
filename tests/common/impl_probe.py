"""A bench-shaped module for ``tests/common/test_impl_rows.py``: prints which kernels its
process loaded and what it was asked."""

from __future__ import annotations

import argparse
import json
import os

from protocol import _native


def run(args: argparse.Namespace) -> int:
    print(json.dumps({"bench": "probe", "env": os.environ.get(_native.ENV_VAR), "loaded": _native.IMPL,
                      "x": args.x, "impl_arg": args.impl}), flush=True)
    print("a line that is not JSON", flush=True)
    return 0
