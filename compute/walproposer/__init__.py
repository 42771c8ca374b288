"""The walproposer bridge: a vanilla PostgreSQL's WAL made durable on a quorum of safekeepers."""
