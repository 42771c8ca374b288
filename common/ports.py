"""Free TCP ports on 127.0.0.1 for test clusters and local nodes.

``free_port()`` never hands out the same port twice in one process, and picks below Linux's
ephemeral range so that no outgoing connection can take the port before the server binds it.
"""

from __future__ import annotations

import random
import socket

# Ports handed out by this process: two callers never get the same one, even before either binds.
_HANDED_OUT: set[int] = set()
# Below Linux's ephemeral range (32768-60999), so outgoing connections cannot take a port between
# the moment it is chosen here and the moment the server binds it.
_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and was not handed out before by this process."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free port in {_PORT_RANGE[0]}-{_PORT_RANGE[1]} after 1000 tries")
