"""PostgreSQL v3 wire protocol: messages, SQLSTATEs and sans-IO decoders.

``messages`` holds every message as a frozen value with ``encode``/``decode``;
``decoder`` frames bytes into messages (``FrontendDecoder`` on servers, ``BackendDecoder``
on clients); ``sqlstate`` names the error codes.
"""

from protocol.pgwire.decoder import (
    CLOSED,
    DEFAULT_MAX_MESSAGE_LEN,
    NEED_DATA,
    BackendDecoder,
    FrontendDecoder,
    Sentinel,
)
from protocol.pgwire.messages import BackendMessage, FrontendMessage, Message, encode

__all__ = [
    "CLOSED",
    "DEFAULT_MAX_MESSAGE_LEN",
    "NEED_DATA",
    "BackendDecoder",
    "BackendMessage",
    "FrontendDecoder",
    "FrontendMessage",
    "Message",
    "Sentinel",
    "encode",
]
