#!/usr/bin/env bash
# The G = 2 measurement session on nvidia-h200-x2 (two H200s over NVLink), three device calls
# back to back (FA4 and Liger wheels from ../shared/device/fast_kernels.sh):
#   1  carry .fa4a:  bash .fa4a/stage.sh; PHASE=1 bash benchmarks/run_x2_session.sh
#      multigpu.py parity / overlap / attention (varlen, every exchange and layout, kv-chunk counts 1 2 4 8);
#      then side by side: GPU 0 `bench ranks --calibrate` (varlen), GPU 1 the GPU tests
#   2  carry .fa4b:  source .fa4b/activate.sh && PHASE=2 bash benchmarks/run_x2_session.sh
#      GPU 0: `bench kernels` (fa4, varlen; 32k at seeds 0-3, 128k), HF flex + fused CE at 512k;
#      GPU 1: `bench model` 16k ours (auto) vs HF flex, then `bench ranks --calibrate` (fa4)
#   1b (no FA4 needed) PHASE=1b: the attention part again at the default kv_chunks (1)
#   3  carry .fa4b:  source .fa4b/activate.sh && PHASE=3 E2E_LAYOUT=... bash benchmarks/run_x2_session.sh
#      multigpu.py e2e (1.2B, fa4 via auto, fused CE) at G = 1 and 2 up to 1M tokens;
#      then the FA4 / Liger GPU tests
#   3b carry .fa4b:  source .fa4b/activate.sh && PHASE=3b E2E_LAYOUT=... bash benchmarks/run_x2_session.sh
#      phase 3's G = 2 rows with DDP (--e2e-grad-sync ddp: bucketed all-reduces overlapped with
#      backward, the README's recipe) beside the per-parameter all-reduce after backward
# Everything lands in $OUT/results.tgz (a call returns only a few files).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/session_lib.sh"
session_start
mg() { torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py "$@"; }
case "$PHASE" in
1)
  timeout 330 bash -c "$(declare -f mg); mg --out $W/g2_varlen --parts parity,overlap,attention --parity-budget-s 120 \
      --overlap-budget-s 90 --attention-budget-s 100 --overlap-chunks 1 2 4 8" >"$W/g2_varlen.log" 2>&1
  ( export CUDA_VISIBLE_DEVICES=0; timeout 200 python3 -m hf_blockdiag_cp.bench ranks --backend varlen --cp-sizes 4 8 \
      --reps 2 --calibrate --out "$W/ranks_varlen" ) >"$W/ranks_varlen.log" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1; timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu ) >"$W/gpu_tests_phase1.log" 2>&1 &
  wait ;;
1b)
  timeout 200 bash -c "$(declare -f mg); mg --out $W/g2_attention --parts attention --kv-chunks 1 --attention-budget-s 150" \
      >"$W/g2_attention.log" 2>&1 ;;
2)
  ( export CUDA_VISIBLE_DEVICES=0
    for seed in 0 1 2 3; do bench kernels --seq-lens 32768 --backends varlen fa4 --dense-max-len 0 --reps 6 --seed $seed --out "$W/kernels_32k_seed$seed"; done
    bench kernels --seq-lens 131072 --backends varlen fa4 --dense-max-len 0 --reps 4 --out "$W/kernels_128k"
    timeout 330 python3 -m hf_blockdiag_cp.bench model --methods hf_flex+fce --seq-lens --fit-methods hf_flex+fce --fit-lens 524288 \
      --rounds 1 --block-steps 2 --out "$W/model_flex_fce_fit" ) >"$W/lane0.log" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 380 python3 -m hf_blockdiag_cp.bench model --methods blockdiag_cp/auto hf_flex --seq-lens 16384 --block-steps 4 --rounds 2 \
      --one-block --out "$W/model_16k"
    timeout 150 python3 -m hf_blockdiag_cp.bench ranks --backend fa4 --cp-sizes 4 8 --reps 2 --calibrate --out "$W/ranks_fa4" ) >"$W/lane1.log" 2>&1 &
  wait ;;
3)
  timeout 380 bash -c "$(declare -f mg); mg --out $W/g2_fa4 --parts e2e --e2e-models 1.2b --e2e-fused-ce \
      --e2e-layout ${E2E_LAYOUT:-contiguous} --e2e-tokens 131072 1048576 --e2e-single --e2e-single-tokens 65536 524288 \
      --e2e-budget-s 330" >"$W/g2_fa4.log" 2>&1
  ( export CUDA_VISIBLE_DEVICES=0; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fa4_fused_ce.py tests/gpu/test_trainer_liger.py ) \
      >"$W/gpu_tests_fa4_liger.log" 2>&1
  ;;
3b)
  for sync in allreduce ddp; do
    timeout 250 bash -c "$(declare -f mg); mg --out $W/g2_fa4_$sync --parts e2e --e2e-models 1.2b --e2e-fused-ce \
        --e2e-layout ${E2E_LAYOUT:-contiguous} --e2e-tokens 131072 --e2e-grad-sync $sync --e2e-budget-s 200" >"$W/g2_fa4_$sync.log" 2>&1
  done ;;
4)  # ours (auto) vs HF flex at 16k alone on GPU 0 (timing-sensitive: nothing else runs)
  ( export CUDA_VISIBLE_DEVICES=0; timeout 400 python3 -m hf_blockdiag_cp.bench model --methods blockdiag_cp/auto hf_flex \
      --seq-lens 16384 --block-steps 4 --rounds 2 --one-block --out "$W/model_16k_alone" ) >"$W/model_16k_alone.log" 2>&1 ;;
esac
session_end "^\||passed|failed|error|Error|largest|^E "
