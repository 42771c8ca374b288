"""The safekeeper: a quorum member that stores the compute's WAL durably and streams it on."""
