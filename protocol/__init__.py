"""Sans-IO codecs for every wire and file format pagestore speaks.

Nothing under this package performs IO: no trio, socket, os or file access
(``tests/protocol/test_sans_io.py`` enforces it). Bytes go in, frozen events come out,
and the reverse.
"""
