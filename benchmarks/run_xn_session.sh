#!/usr/bin/env bash
# Issue 17's session on nvidia-h200-x4 or -x8 (G = NPROC GPUs of one host, NVLink), device calls
# back to back (FA4 and Liger wheels from ../shared/device/fast_kernels.sh; after call 2 a warm
# machine needs only `source .fa4b/activate.sh` with .fa4b carried):
#   1  carry .fa4a:  bash .fa4a/stage.sh; NPROC=4 PHASE=1 bash benchmarks/run_xn_session.sh
#      multigpu.py attention (ring-flash-attn and MagiAttention setups) and overlap
#   2  carry .fa4b:  source .fa4b/activate.sh && NPROC=4 PHASE=2 bash benchmarks/run_xn_session.sh
#      multigpu.py parity with FA4 importable (every kernel x exchange x layout, bf16, checkpointing,
#      an all-padding rank, one document over all ranks)
#   3  carry .fa4b:  source .fa4b/activate.sh && NPROC=4 PHASE=3 bash benchmarks/run_xn_session.sh
#      e2e, 1.2B with fa4 (auto) and fused CE, balanced layout: G = NPROC at the packs G = 1 trains
#      (64k and 512k per GPU) and one doubling beyond (the largest that trains); then G = 1 on GPU 0
#   4  carry .fa4b:  the same for the 8B config (64k and 256k per GPU)
# Then: python benchmarks/multigpu.py --summarize <the runs' folders> --out benchmarks/results/multigpu
# and python benchmarks/scaling_model.py --multigpu <the run's multigpu_G*.json> --validate-only.
# Everything lands in $OUT/results_phase<P>.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/session_lib.sh"
session_start
N=${NPROC:?set NPROC to the GPUs of the machine (4 or 8)}
# DEVICE=cpu MG_EXTRA=--tiny: a smoke run of phases 1-2 on gloo (no GPU)
mg() { torchrun --standalone --nproc-per-node "$N" benchmarks/multigpu.py --device "${DEVICE:-cuda}" ${MG_EXTRA:-} "$@"; }
e2e() {  # model per_gpu_tokens... ; the G = N packs hold N x the per-GPU tokens
  local model=$1; shift
  local tokens=() single=()
  for t in "$@"; do tokens+=($((t * N))); single+=("$t"); done
  timeout 540 bash -c "$(declare -f mg); N=$N; mg --out $W/g${N}_e2e_$model --parts e2e --e2e-models $model --e2e-fused-ce \
      --e2e-layout balanced --e2e-tokens ${tokens[*]} --e2e-max-tokens $((${tokens[-1]} * 2)) --e2e-single \
      --e2e-single-tokens ${single[*]} --e2e-budget-s 500 --e2e-child-timeout-s 240" >"$W/g${N}_e2e_$model.log" 2>&1
}
case "$PHASE" in
1)
  timeout 560 bash -c "$(declare -f mg); N=$N; mg --out $W/g${N}_attention --parts attention,overlap \
      --attention-budget-s 300 --overlap-budget-s 150 --overlap-chunks 1 2 4" >"$W/g${N}_attention.log" 2>&1 ;;
2)
  timeout 560 bash -c "$(declare -f mg); N=$N; mg --out $W/g${N}_parity --parts parity --parity-budget-s 480" \
      >"$W/g${N}_parity.log" 2>&1 ;;
3)
  e2e 1.2b 65536 524288 ;;
4)
  e2e 8b 65536 262144 ;;
esac
session_end "^\||passed|failed|error|Error|largest|^E "
