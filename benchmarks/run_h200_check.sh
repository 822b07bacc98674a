#!/usr/bin/env bash
# One device call on an H200: install, probe gloo+CUDA, run the GPU tests, bench kernels.
# Usage (device tool): bash benchmarks/run_h200_check.sh   (writes under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || export PYTHONPATH=$PWD
python3 -c "import torch, transformers, hf_blockdiag_cp; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee -a "$OUT/env.txt"
timeout 60 python3 benchmarks/probe_gloo_cuda.py 2>&1 | grep gloo | tee "$OUT/probe.txt"
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -o timeout=300 tests/test_gpu.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|assert|^FAILED" | tail -40
if [ -n "${KERNEL_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 -m hf_blockdiag_cp.bench kernels --out "$OUT" $KERNEL_BENCH 2>&1 | tee "$OUT/kernels.log" | tail -15
fi
