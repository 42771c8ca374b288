"""PostgreSQL 15 write-ahead log: page headers, records, a stream decoder and an encoder.

- ``protocol.wal.record``: ``DecodedRecord``, ``BlockRef``, ``RelFileNode``,
  ``XLogRecordHeader`` and ``decode_record`` (the interface ingest and redo build on).
- ``protocol.wal.page``: page headers and ``record_end_lsn``.
- ``protocol.wal.reader``: ``WalStreamDecoder``, a sans-IO reader that reassembles records
  across pages and segments and reports where valid WAL ends (``EndOfWal``).
- ``protocol.wal.encoder``: ``WalEncoder``, which writes valid WAL for synthetic records.
- ``protocol.wal.rmgr``: resource manager ids, names and record-type constants.
- ``protocol.wal.pglz``: pglz (de)compression for compressed full-page images.
- ``protocol.wal.walk``: ``walk_crc``, the least a Python reader does per record (header,
  page boundaries, CRC): the ``walk-crc-min`` floor of ``pagestore bench bulk-ingest``.
"""
