"""Benchmark drivers; each prints JSON lines, one per measured configuration."""
