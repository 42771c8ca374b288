"""Free TCP ports on 127.0.0.1 for test clusters and local nodes.

``free_port()`` never hands out the same port twice in one process, and picks below Linux's
ephemeral range so that no outgoing connection can take the port before the server binds it.
Under pytest-xdist each worker (``PYTEST_XDIST_WORKER`` gw0, gw1, ...) picks from its own
slice of that range, so two workers never hand out the same port either.
"""

from __future__ import annotations

import os
import random
import re
import socket

# Ports handed out by this process: two callers never get the same one, even before either binds.
_HANDED_OUT: set[int] = set()
# Below Linux's ephemeral range (32768-60999), so outgoing connections cannot take a port between
# the moment it is chosen here and the moment the server binds it.
_PORT_RANGE = (20000, 32000)


def port_range() -> tuple[int, int]:
    """[low, high) this process picks from: the whole range, or an xdist worker's slice."""
    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker is None or count < 2 or int(worker.group(1)) >= count:
        return _PORT_RANGE
    width = (_PORT_RANGE[1] - _PORT_RANGE[0]) // count
    low = _PORT_RANGE[0] + int(worker.group(1)) * width
    return low, low + width


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and was not handed out before by this process."""
    rng = random.Random()
    low, high = port_range()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free port in {low}-{high} after 1000 tries")
