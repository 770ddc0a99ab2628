"""Benchmarking code behind `fastspec bench`: offline (speculative vs plain in one process and run) and serving
(a running server under Poisson load). Values only; fastspec.cli.bench renders them."""
