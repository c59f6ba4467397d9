"""rollpipe benchmarks: `python -m bench.run [--quick]` (also `nox -s bench`).

Every figure is a ratio (or a time) measured side by side in one run and repeated; the
median is reported. See bench/README.md for what each benchmark measures.
"""
