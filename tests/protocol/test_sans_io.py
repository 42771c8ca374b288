"""protocol/ must never do IO: importing every module pulls in no IO-capable module."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import protocol

FORBIDDEN = {"trio", "socket", "os", "io", "asyncio", "selectors", "subprocess", "select", "ssl"}
# The implementation selector reads PAGESTORE_PURE_PYTHON and hashes its sources (native.md §7):
# the one protocol/ module allowed os.
ALLOWED = {"_native.py": {"os"}}


def test_protocol_imports_no_io_modules() -> None:
    root = Path(protocol.__file__).parent
    modules = [m.name for m in pkgutil.walk_packages([str(root)], prefix="protocol.")]
    assert modules, "protocol/ has no modules?"
    # A fresh interpreter: this process has long imported os and trio itself. The interpreter
    # core imports os, io and friends at start-up, so we compare against a bare baseline.
    probe = (
        "import sys; base = set(sys.modules); "
        + "; ".join(f"import {m}" for m in modules)
        + "; print(' '.join(sorted(set(sys.modules) - base)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    new = set(out.stdout.split())
    assert not (new & FORBIDDEN), f"protocol/ pulled in IO modules: {sorted(new & FORBIDDEN)}"
    # os and io are preloaded by the interpreter, so also check the source for direct imports.
    for path in root.rglob("*.py"):
        text = path.read_text()
        for name in FORBIDDEN - ALLOWED.get(path.name, set()):
            assert f"\nimport {name}\n" not in text and f"\nfrom {name} " not in text, (
                f"{path} imports {name}"
            )
