"""Which implementation of the kernels runs: the compiled modules or their pure-Python twins.

Read once, at import, from ``PAGESTORE_PURE_PYTHON``:

- unset: the compiled modules (``protocol/_*_c.pyx``, built by ``pip install -e .``). A module
  that is missing, fails to load, or was built from other sources than those on disk is an
  ImportError naming the module, the cause and both fixes. There is no silent fallback: a
  pagestore that quietly ran the twins would be several times slower with nothing said.
- ``1``: the pure-Python twins (``protocol/_*_py.py``), the reference implementations.
- anything else: an ImportError (``0`` or ``yes`` are not guessed at).

This is the only protocol/ module that reads the environment (the sans-IO test allows it).
Public modules import their kernels through ``require()`` and re-export one ``__all__``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Final, Literal

from protocol._native_sources import NATIVE_MODULES, TWINS, source_hash

__all__ = ["ENV_VAR", "IMPL", "describe", "require"]

ENV_VAR: Final = "PAGESTORE_PURE_PYTHON"
_FIXES = (
    "build the extensions with `pip install -e .` (./scripts/setup does it), "
    f"or set {ENV_VAR}=1 to run the pure-Python twins"
)
_ROOT = Path(__file__).resolve().parent.parent


def _select() -> Literal["native", "python"]:
    value = os.environ.get(ENV_VAR)
    if value is None:
        return "native"
    if value == "1":
        return "python"
    raise ImportError(
        f"{ENV_VAR}={value!r} is not understood: set it to 1 for the pure-Python twins, "
        "or unset it for the compiled modules"
    )


IMPL: Final[Literal["native", "python"]] = _select()


def _expected_hash(name: str) -> str | None:
    """The hash of ``name``'s sources on disk, or None where they are not shipped (a wheel)."""
    files = NATIVE_MODULES[name]
    try:
        return source_hash((f, (_ROOT / f).read_bytes()) for f in files)
    except FileNotFoundError:
        return None


def load_native(name: str) -> ModuleType:
    """Import the compiled module ``name`` and check it was built from the sources on disk."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"pagestore's compiled module {name} cannot be imported ({exc}): {_FIXES}"
        ) from exc
    built = getattr(module, "SOURCE_HASH", None)
    expected = _expected_hash(name)
    if expected is not None and built != expected:
        raise ImportError(
            f"pagestore's compiled module {name} is stale: built from sources {built}, "
            f"the files on disk hash to {expected}: {_FIXES}"
        )
    return module


def require(name: str) -> ModuleType:
    """The implementation of kernel module ``name`` (``"protocol._wal_c"``) that ``IMPL`` selects:
    the checked compiled module, or its pure-Python twin."""
    if name not in NATIVE_MODULES:
        raise LookupError(f"{name} is not a pagestore native module (protocol/_native_sources.py)")
    if IMPL == "python":
        return importlib.import_module(TWINS[name])
    return load_native(name)


def describe() -> dict[str, str]:
    """What runs, for ``pagestore --version``, ``/v1/status`` and logs: ``impl`` and the
    CRC-32C kernel."""
    wal = require("protocol._wal_c")
    for name in NATIVE_MODULES:
        require(name)  # every one loads, and none is stale
    return {"impl": IMPL, "crc32c": str(wal.crc32c_kernel())}
