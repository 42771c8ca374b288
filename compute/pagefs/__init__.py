"""The page filesystem of a lazy endpoint: a vanilla PostgreSQL 15 whose ``base/`` and
``global/`` are a FUSE filesystem (pyfuse3 on trio) over the page service.

Relation segment files (``<relfilenode>[_fsm|_vm|_init][.N]``) are virtual: their sizes come from
the pageserver's relation listing at the endpoint's start LSN S, a kernel read becomes GetPage
requests folded into one pipelined batch, and the kernel's page cache keeps what was read
(``keep_cache``). Written pages go to the local page file (``cache_file``), a bounded cache with
an index (``store``). Every other file there (``PG_VERSION``, ``pg_filenode.map``,
``pg_internal.init``, ``pg_control``, temp relations, spill files) is an ordinary local file.

**Durability.** ``fsync`` is answered ENOSYS (the kernel then stops sending it): a page written
here is never the durable copy. PostgreSQL flushes the WAL of every change before it writes the
page (``FlushBuffer``), the walproposer bridge makes a commit wait for a quorum of safekeepers,
and the pageserver rebuilds every logged page from that WAL. A page filesystem that dies takes
only its cache with it; ``pagestore endpoint start`` starts a new one with an empty cache.

**The LSN rules** (the correctness core; ``docs/compute.md`` has their reasons):

- R1. A block this compute never wrote is read at ``not_modified_since`` = S (a primary asks
  for the latest version, ``request_lsn`` = MAX; a read-only endpoint at S). PostgreSQL reads
  only blocks it does not hold in shared buffers, so there is no change after S it could expect.
- R2. A write replaces the block in the local page file; a remote read in flight for that
  block loses to it. An all-zero block takes no slot.
- R3. A written block may leave the cache (be evicted) only when its pd_lsn L is a real WAL
  position (>= 0/1000000), the safekeepers hold WAL up to L, and none of the hazards below
  holds. Then R4: it is re-read at ``not_modified_since`` = max(L, S): never an older version
  than this compute wrote, since every logged change to it is at or below L and what differs
  from the pageserver's page at L is hints only. The map of evicted LSNs is bounded: past the
  bound an entry is dropped and its LSN becomes a floor for every read without an entry (R1
  then uses max(floor, S)): a larger ``not_modified_since`` is always correct, it only waits.
- R5. FSM pages are hints: always evictable, re-read at S (or L); a failed FSM read is zeros.
- What is not in WAL never leaves the local cache: every fork of an unlogged relation (one with
  an ``_init`` file), init forks, pages whose pd_lsn is no real LSN (relations built without WAL:
  GIN/GiST builds before ``log_newpage_range``, unlogged GiST fake LSNs).
- R6/R7. Sizes are local metadata seeded from the listing at S; truncation drops blocks at or
  past the new end (a re-extended block reads as zeros, not as the pageserver's old page);
  unlink forgets the file and a reused relfilenode starts empty.
- Hazards (``docs/compute.md`` §4.4), what follows from them:
  H1 PD_ALL_VISIBLE is set without an LSN bump unless ``wal_log_hints = on``: endpoints run with
  it on; without it written heap pages with PD_ALL_VISIBLE stay local.
  H2 visibility-map bits are cleared without an LSN bump: written VM pages stay local.
  H3 btree pages with a nonzero vacuum cycle id stay local (redo zeroes it).
  H4 FILE_COPY databases carry their source's pd_lsn: every page written into a database
  directory this compute created stays local.
- Anything these rules do not cover stays local: nothing is guessed.
"""
