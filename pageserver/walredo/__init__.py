"""WAL redo in pure Python: rebuild PostgreSQL 15 pages from images and WAL records."""
