"""The materialized page cache: reconstructed values keyed by (timeline, key, lsn), bounded in bytes.

An entry at ``lsn`` is the value as of ``lsn`` where ``lsn`` is the newest record applied, not
the request LSN (storage.md §3.6): a later read at any LSN >= it may start from it and replay
only the records above. ``lookup`` returns the newest entry at or below the requested LSN.
Eviction is LRU by bytes. Hits and misses are Prometheus counters.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

from pageserver.storage.key import Key


class _LookupCounter:
    """A Prometheus counter that is a plain int add per ``inc`` (every page read looks up the
    cache once, and ``prometheus_client.Counter.inc`` takes a lock: a measurable share of a
    vectored read's per-key cost). Lookups run on the trio thread only; a scrape from another
    thread reads one int."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0
        REGISTRY.register(self)

    def inc(self) -> None:
        self.value += 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value)


PAGE_CACHE_HITS = _LookupCounter(
    "pageserver_materialized_cache_hits", "materialized page cache lookups that found an entry"
)
PAGE_CACHE_MISSES = _LookupCounter(
    "pageserver_materialized_cache_misses", "materialized page cache lookups that found nothing"
)

_ENTRY_OVERHEAD = 64  # rough per-entry bookkeeping, so tiny values cannot grow it unbounded


class PageCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._lru: OrderedDict[tuple[bytes, Key, int], bytes] = OrderedDict()
        self._lsns: dict[tuple[bytes, Key], list[int]] = {}
        self.hits = 0
        self.misses = 0

    def lookup(self, timeline: bytes, key: Key, lsn: int) -> tuple[int, bytes] | None:
        """Newest entry with entry lsn <= ``lsn``, as (entry lsn, bytes)."""
        lsns = self._lsns.get((timeline, key))
        if lsns:
            i = bisect.bisect_right(lsns, lsn)
            if i:
                found = lsns[i - 1]
                page = self._lru[(timeline, key, found)]
                self._lru.move_to_end((timeline, key, found))
                self.hits += 1
                PAGE_CACHE_HITS.value += 1
                return found, page
        self.misses += 1
        PAGE_CACHE_MISSES.value += 1
        return None

    def lookup_many(self, timeline: bytes, requests: Mapping[Key, int]) -> dict[Key, tuple[int, bytes]]:
        """``lookup`` of every (key, lsn) of ``requests``: the hits (a batch of reads, with
        the counters added once)."""
        hits: dict[Key, tuple[int, bytes]] = {}
        index = self._lsns
        if index:
            lru = self._lru
            for key, lsn in requests.items():
                lsns = index.get((timeline, key))
                if lsns:
                    i = bisect.bisect_right(lsns, lsn)
                    if i:
                        found = lsns[i - 1]
                        ck = (timeline, key, found)
                        hits[key] = (found, lru[ck])
                        lru.move_to_end(ck)
        n_hits = len(hits)
        n_misses = len(requests) - n_hits
        self.hits += n_hits
        self.misses += n_misses
        PAGE_CACHE_HITS.value += n_hits
        PAGE_CACHE_MISSES.value += n_misses
        return hits

    def holds(self, timeline: bytes, key: Key) -> bool:
        """Whether any entry of ``key`` is cached (at any LSN): only then can ``lookup`` hit."""
        return (timeline, key) in self._lsns

    def count_misses(self, n: int) -> None:
        """``n`` lookups that would have missed (keys ``holds`` says have no entry) and were
        answered without one: the counters as if they had been looked up."""
        self.misses += n
        PAGE_CACHE_MISSES.value += n

    def memorize(self, timeline: bytes, key: Key, lsn: int, page: bytes) -> None:
        if self.capacity_bytes <= 0:
            return
        ck = (timeline, key, lsn)
        if ck in self._lru:
            self._lru.move_to_end(ck)
            return
        cost = len(page) + _ENTRY_OVERHEAD
        if cost > self.capacity_bytes:
            return
        self._lru[ck] = page
        bisect.insort(self._lsns.setdefault((timeline, key), []), lsn)
        self.size_bytes += cost
        while self.size_bytes > self.capacity_bytes:
            (tl, k, old_lsn), old = self._lru.popitem(last=False)
            self.size_bytes -= len(old) + _ENTRY_OVERHEAD
            lsns = self._lsns[(tl, k)]
            lsns.remove(old_lsn)
            if not lsns:
                del self._lsns[(tl, k)]

    def clear(self) -> None:
        self._lru.clear()
        self._lsns.clear()
        self.size_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)
