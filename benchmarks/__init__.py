"""Benchmarks: the machinery of `python -m benchmarks ...` (upstreams, process manager, load
generator, reports) and one-off measuring scripts. Lives beside the packages, outside the wheel:
run from a checkout."""
