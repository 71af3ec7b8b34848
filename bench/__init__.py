"""Benchmarks: ``python -m bench`` runs them on a CUDA GPU (``--list`` names them); results in bench/results/."""
