#!/usr/bin/env bash
# One device call on an H200: install, then whichever parts are asked for, each under its own
# time limit so one slow part cannot eat the call. Results land under $OUT.
#   TESTS="<pytest args>"   GPU tests (e.g. "tests/gpu", or "tests/gpu/test_gpu.py")
#   KERNELS="<args>"        python -m hf_blockdiag_cp.bench kernels <args>
#   MODEL="<args>"          python -m hf_blockdiag_cp.bench model <args>
#   RANKS="<args>"          python -m hf_blockdiag_cp.bench ranks <args>
#   *_LIMIT                 seconds for each part (defaults below)
#   ORDER="KERNELS TESTS"  order of the parts (default: TESTS KERNELS MODEL RANKS)
#   SKIP_INSTALL=1          the project is already installed (benchmarks/run_lanes.sh installs once)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || export PYTHONPATH=$PWD
fi
python3 -c "import torch, transformers, hf_blockdiag_cp; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee -a "$OUT/env.txt"
for part in ${ORDER:-TESTS KERNELS MODEL RANKS}; do
  args="${!part:-}"; limit_var="${part}_LIMIT"
  [ -n "$args" ] || continue
  if [ "$part" = TESTS ]; then
    eval timeout "${TESTS_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -o timeout=280 "$TESTS" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|^E  |^FAILED" | tail -30
    continue
  fi
  name=$(echo "$part" | tr 'A-Z' 'a-z')
  timeout "${!limit_var:-240}" python3 -m hf_blockdiag_cp.bench "$name" --out "$OUT" $args >"$OUT/$name.log" 2>&1
  echo "== bench $name (rc=$?)"; grep -E "^\||largest" "$OUT/$name.log" || tail -5 "$OUT/$name.log"
done
