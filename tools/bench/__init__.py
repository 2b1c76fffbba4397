"""Benchmarks: python -m tools.bench.NAME; the last line printed is one JSON object."""
