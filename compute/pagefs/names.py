"""File names in ``base/``, ``global/`` and tablespaces' database directories: which are relation segment files the page store
serves (``<relfilenode>[_fsm|_vm|_init][.N]``), and which are ordinary local files
(``PG_VERSION``, ``pg_filenode.map``, ``pg_internal.init*``, ``pg_control``, temp relations
``t<backend>_<relfilenode>…`` and the ``pgsql_tmp`` spill files)."""

from __future__ import annotations

import re
from typing import Final

import attrs

RELSEG_SIZE: Final = 131072  # blocks per 1 GiB segment file
MAIN: Final = 0
FSM: Final = 1
VM: Final = 2
INIT: Final = 3
FORK_SUFFIX: Final = {MAIN: "", FSM: "_fsm", VM: "_vm", INIT: "_init"}
FORK_BY_NAME: Final = {"main": MAIN, "fsm": FSM, "vm": VM, "init": INIT}
GLOBAL_SPC: Final = 1664
DEFAULT_SPC: Final = 1663
TABLESPACE_VERSION_DIRECTORY: Final = "PG_15_202209061"  # pg_tblspc/<spc>/<this>/<db>/ (catversion.h)

_REL = re.compile(r"^([1-9][0-9]{0,9})(_fsm|_vm|_init)?(?:\.([1-9][0-9]{0,5}))?$")
_SUFFIX_FORK: Final = {None: MAIN, "_fsm": FSM, "_vm": VM, "_init": INIT}


@attrs.frozen
class RelFileName:
    relnode: int
    fork: int
    segno: int

    def name(self) -> str:
        return f"{self.relnode}{FORK_SUFFIX[self.fork]}" + (f".{self.segno}" if self.segno else "")


def parse_rel_file(name: str) -> RelFileName | None:
    """The relation segment a name denotes, or None for every other file."""
    m = _REL.match(name)
    if m is None:
        return None
    relnode = int(m.group(1))
    if relnode > 0xFFFF_FFFF:
        return None
    return RelFileName(relnode, _SUFFIX_FORK[m.group(2)], int(m.group(3) or 0))


def segments(nblocks: int) -> list[int]:
    """Block counts of the segment files of a fork of ``nblocks`` (segment 0 always exists)."""
    if nblocks <= 0:
        return [0]
    full, rest = divmod(nblocks, RELSEG_SIZE)
    return [RELSEG_SIZE] * full + ([rest] if rest else [])
