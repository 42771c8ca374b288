"""The pageserver: tenants, timelines, the storage engine, WAL ingest and redo, page service."""
