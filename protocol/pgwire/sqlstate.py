"""SQLSTATE codes pagestore sends or recognises (PostgreSQL's errcodes.txt names, upper-cased).

Only codes someone uses live here; add more with their PostgreSQL name.
"""

from __future__ import annotations

from typing import Final

from protocol.errors import INTERNAL_ERROR, PROTOCOL_VIOLATION

SUCCESSFUL_COMPLETION: Final = "00000"
# Class 08: connection exceptions (PROTOCOL_VIOLATION 08P01 comes from protocol.errors).
CONNECTION_EXCEPTION: Final = "08000"
CONNECTION_FAILURE: Final = "08006"  # neon: "reconnect" / disconnected
SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION: Final = "08001"
# Class 0A: feature not supported (extended query protocol, unknown commands' features).
FEATURE_NOT_SUPPORTED: Final = "0A000"
# Class 22: data exceptions.
CHARACTER_NOT_IN_REPERTOIRE: Final = "22021"
INVALID_PARAMETER_VALUE: Final = "22023"
# Class 28: authorization.
INVALID_AUTHORIZATION_SPECIFICATION: Final = "28000"
INVALID_PASSWORD: Final = "28P01"
# Class 42: syntax errors (an unknown command on our servers).
SYNTAX_ERROR: Final = "42601"
UNDEFINED_OBJECT: Final = "42704"
# Class 53/54: resources and limits.
TOO_MANY_CONNECTIONS: Final = "53300"
PROGRAM_LIMIT_EXCEEDED: Final = "54000"
# Class 57: operator intervention.
QUERY_CANCELED: Final = "57014"
ADMIN_SHUTDOWN: Final = "57P01"
IDLE_SESSION_TIMEOUT: Final = "57P05"
# Class 58: system errors outside PostgreSQL (IO).
IO_ERROR: Final = "58030"
# Class XX: internal errors (INTERNAL_ERROR XX000 comes from protocol.errors).
DATA_CORRUPTED: Final = "XX001"

__all__ = [
    "ADMIN_SHUTDOWN",
    "CHARACTER_NOT_IN_REPERTOIRE",
    "CONNECTION_EXCEPTION",
    "CONNECTION_FAILURE",
    "DATA_CORRUPTED",
    "FEATURE_NOT_SUPPORTED",
    "IDLE_SESSION_TIMEOUT",
    "INTERNAL_ERROR",
    "INVALID_AUTHORIZATION_SPECIFICATION",
    "INVALID_PARAMETER_VALUE",
    "INVALID_PASSWORD",
    "IO_ERROR",
    "PROGRAM_LIMIT_EXCEEDED",
    "PROTOCOL_VIOLATION",
    "QUERY_CANCELED",
    "SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION",
    "SUCCESSFUL_COMPLETION",
    "SYNTAX_ERROR",
    "TOO_MANY_CONNECTIONS",
    "UNDEFINED_OBJECT",
]
