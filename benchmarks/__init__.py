"""Benchmarks (not tests): each runs as ``python -m benchmarks.<name>`` and writes JSON + PNG to
``benchmarks/results/``. See ``benchmarks/README.md``."""
