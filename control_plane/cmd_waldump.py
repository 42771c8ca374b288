"""``pagestore waldump``: placeholder module replaced by the WAL decoder's owner."""
