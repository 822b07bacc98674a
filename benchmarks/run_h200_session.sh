#!/usr/bin/env bash
# The single-H200 measurement session of 2026-12-01 (nvidia-h200; the 2-GPU kind was not lent),
# three device calls back to back (FA4 and Liger wheels from ../shared/device/fast_kernels.sh):
#   A  carry .fa4a:  bash .fa4a/stage.sh; PHASE=A bash benchmarks/run_h200_session.sh
#      `bench ranks` (varlen, balanced, G 4 and 8) on the all-gather's key buffer and on a2a's, calibrated
#   B  carry .fa4b:  source .fa4b/activate.sh && PHASE=B bash benchmarks/run_h200_session.sh
#      `bench kernels` (fa4, varlen; 32k at seeds 0-3, 128k), `bench ranks` (fa4, both buffers),
#      `bench model --profile` 16k ours (auto, varlen)
#   C  carry .fa4b:  source .fa4b/activate.sh && PHASE=C bash benchmarks/run_h200_session.sh
#      `bench model` 16k ours (auto) vs HF flex, nothing else on the machine; then the GPU tests
#   D1 carry .fa4a:  bash .fa4a/stage.sh; PHASE=D1 bash benchmarks/run_h200_session.sh
#      after the row-swap refinement and the a2a calibration were committed: `bench ranks` (varlen, a2a)
#   D2 carry .fa4b:  source .fa4b/activate.sh && PHASE=D2 bash benchmarks/run_h200_session.sh
#      `bench ranks` (fa4, a2a); then the GPU tests, in two processes side by side
# The second session of 2026-12-01 (after the needed-key gather's level-wise backward):
#   E1 carry .fa4a:  bash .fa4a/stage.sh; PHASE=E1 bash benchmarks/run_h200_session.sh
#      `bench ranks` (varlen, a2a); benchmarks/gather_ab.py (the gather alone, old against new)
#   E2 carry .fa4b:  source .fa4b/activate.sh && PHASE=E2 bash benchmarks/run_h200_session.sh
#      `bench ranks` (fa4, a2a); then the GPU tests, in two processes side by side
#   RANKS KERNELS="varlen" (then, FA4 staged and activated as above, KERNELS="fa4"):
#      `bench ranks` (a2a, balanced, G 4 and 8, calibrated) with the constants in kernels/calibration.json;
#      2026-12-01b/F: planned with the E fits, G: with the E and F samples pooled (--calibrate-from);
#      REPS / CALLS (default 3 / 2) set bench ranks' --reps / --calls (H: G repeated with 5 / 3)
# Everything lands in $OUT/results_phase<P>.tgz.
set -uo pipefail
source "$(dirname "$0")/session_lib.sh"
session_start
ranks() {  # kernel exchange budget_s
  timeout "$3" python3 -m hf_blockdiag_cp.bench ranks --backend "$1" --exchange "$2" --strategies balanced --cp-sizes 4 8 \
    --reps "${REPS:-3}" --calls "${CALLS:-2}" --calibrate --out "$W/ranks_$1_$2" >"$W/ranks_$1_$2.log" 2>&1
}
case "$PHASE" in
A)
  ranks varlen a2a 220
  ranks varlen allgather 220 ;;
B)
  for seed in 0 1 2 3; do
    timeout 60 python3 -m hf_blockdiag_cp.bench kernels --seq-lens 32768 --backends varlen fa4 --dense-max-len 0 --reps 6 \
      --seed $seed --out "$W/kernels_32k_seed$seed" >"$W/kernels_32k_seed$seed.log" 2>&1
  done
  timeout 90 python3 -m hf_blockdiag_cp.bench kernels --seq-lens 131072 --backends varlen fa4 --dense-max-len 0 --reps 4 \
    --out "$W/kernels_128k" >"$W/kernels_128k.log" 2>&1
  ranks fa4 a2a 120
  ranks fa4 allgather 100
  timeout 100 python3 -m hf_blockdiag_cp.bench model --methods blockdiag_cp/auto blockdiag_cp/varlen --seq-lens 16384 \
    --block-steps 3 --rounds 2 --profile --out "$W/model_16k_profile" >"$W/model_16k_profile.log" 2>&1 ;;
C)
  timeout 330 python3 -m hf_blockdiag_cp.bench model --methods blockdiag_cp/auto hf_flex --seq-lens 16384 --block-steps 4 \
    --rounds 2 --one-block --out "$W/model_16k" >"$W/model_16k.log" 2>&1
  timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu >"$W/gpu_tests.log" 2>&1 ;;
D1)
  ranks varlen a2a 200 ;;
RANKS)
  for k in $KERNELS; do ranks "$k" a2a 210; done ;;
E1)
  ranks varlen a2a 210
  timeout 90 python3 benchmarks/gather_ab.py --out "$W/gather_ab" >"$W/gather_ab.log" 2>&1 ;;
D2|E2)
  ranks fa4 a2a 150
  ( timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fa4_fused_ce.py tests/gpu/test_trainer_liger.py \
      >"$W/gpu_tests_fa4_liger.log" 2>&1 ) &
  ( timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_flex_features_cuda.py \
      tests/gpu/test_kernels_optional_gpu.py >"$W/gpu_tests_rest.log" 2>&1 ) &
  wait ;;
esac
session_end "^\| [a-z_0-9]+ \| [48] \||passed|failed|error|Error|kernel cost|max relative"
