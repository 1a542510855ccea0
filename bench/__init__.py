"""``make bench``: the side-by-side benchmarks (run as ``python -m bench.sidebyside`` from the
repository root)."""
