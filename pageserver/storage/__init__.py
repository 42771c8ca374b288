"""The storage engine: keys, values, layers, layer map, read paths, compaction, GC."""
