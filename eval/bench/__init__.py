"""Benchmarks run by ``triage bench``: each starts its own servers on loopback and writes a JSON report."""
