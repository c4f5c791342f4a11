"""Micro-benchmarks: one module per benchmark, discovered by ``recpipe bench`` (see recpipe/commands/bench.py)."""
