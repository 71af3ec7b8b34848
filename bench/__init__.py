"""Benchmarks (run on the GPU machine): python -m bench.run_all."""
