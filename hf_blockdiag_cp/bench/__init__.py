"""Benchmarks: `python -m hf_blockdiag_cp.bench {kernels,model,ranks}` (see README, Performance)."""
