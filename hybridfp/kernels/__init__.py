"""Fast implementations of format math and GEMMs (Triton kernels, cuBLAS through torch).

Each module holds pure functions on raw tensors; the registries in ``hybridfp.gemm`` and
``hybridfp.quantizers`` decide when they run.
"""
