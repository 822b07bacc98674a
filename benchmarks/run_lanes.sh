#!/usr/bin/env bash
# One device call on a machine of several GPUs: independent single-GPU parts run side by side,
# one lane per GPU (each lane is `benchmarks/run_h200.sh` with its own variables and its own
# output folder), optionally next to a multi-GPU command. Only 8 files come back from a call,
# so everything is archived into $OUT/results.tgz at the end; the lanes' summaries are printed.
#   LANE0="TESTS='tests/gpu/test_flex_features_cuda.py' KERNELS='--seq-lens 32768'"   run on GPU 0
#   LANE1="MODEL='--seq-lens 16384'"                                           run on GPU 1 (and so on)
#   MULTI="<command>"     run alongside the lanes on every GPU (e.g. a torchrun smoke run); $W is the results folder
#   NICE=19 inside a lane  run that lane at low CPU priority (keeps compile-heavy lanes off a timed one)
#   LIMIT                 seconds for everything before the archive is written (default 560)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"; W=$(mktemp -d); export W
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$W/pip.log" 2>&1 || export PYTHONPATH=$PWD
nvidia-smi topo -m >"$W/topo.txt" 2>&1
pids=()
for i in $(seq 0 15); do
  lane_var="LANE$i"; [ -n "${!lane_var:-}" ] || continue
  mkdir -p "$W/gpu$i"
  ( eval "export CUDA_VISIBLE_DEVICES=$i SKIP_INSTALL=1 OUT=$W/gpu$i ${!lane_var}"; nice -n "${NICE:-0}" timeout "${LIMIT:-560}" bash benchmarks/run_h200.sh ) >"$W/gpu$i/lane.log" 2>&1 &
  pids+=($!)
done
if [ -n "${MULTI:-}" ]; then
  mkdir -p "$W/multi"
  ( timeout "${LIMIT:-560}" bash -c "$MULTI" ) >"$W/multi/multi.log" 2>&1 &
  pids+=($!)
fi
wait "${pids[@]}"
for f in "$W"/gpu*/lane.log "$W"/multi/multi.log; do [ -f "$f" ] && { echo "=== $f"; tail -40 "$f"; }; done
tar -czf "$OUT/results.tgz" -C "$W" .
ls -la "$OUT"
