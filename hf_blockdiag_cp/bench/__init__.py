"""Benchmarks: `python -m hf_blockdiag_cp.bench {kernels,model,ranks,scaling}` (docs/performance.md, docs/scaling.md)."""
