"""Offline evaluation and benchmarks."""
