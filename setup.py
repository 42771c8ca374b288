"""Build pagestore's Cython extensions (everything else is in pyproject.toml).

``pip install -e .`` runs this with Cython from build isolation (``build-system.requires``).
Each extension gets its sources' hash as ``PAGESTORE_SOURCE_HASH`` (protocol/_native_sources.py)
so the import can refuse a stale build. No extension is optional: a compile error fails the
install, never a quiet pure-Python package (``PAGESTORE_PURE_PYTHON=1`` is the explicit way).
"""

from __future__ import annotations

import runpy
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
_sources = runpy.run_path(str(ROOT / "protocol" / "_native_sources.py"))

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,  # the kernels index raw pointers after explicit length checks
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "autotestdict": False,
    "embedsignature": True,
}


def _extension(name: str, files: tuple[str, ...]) -> Extension:
    digest = _sources["source_hash"]((f, (ROOT / f).read_bytes()) for f in files)
    return Extension(
        name,
        sources=[files[0]],
        depends=list(files[1:]),
        include_dirs=[str(ROOT / Path(files[0]).parent)],
        define_macros=[("PAGESTORE_SOURCE_HASH", f'"{digest}"')],
        extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
    )


setup(
    ext_modules=cythonize(
        [_extension(n, f) for n, f in _sources["NATIVE_MODULES"].items()],
        compiler_directives=DIRECTIVES,
        quiet=True,
    ),
)
