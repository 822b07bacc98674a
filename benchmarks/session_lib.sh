# Shared by the device-session scripts (run_h200_session.sh, run_x2_session.sh); source it.
# session_start: $OUT and a work folder $W, the project installed (or on PYTHONPATH), versions in $W/env_phase$PHASE.txt.
# bench ARGS: python -m hf_blockdiag_cp.bench ARGS.
# session_end PATTERN: each log's matching lines, then every result in $OUT/results_phase$PHASE.tgz.
session_start() {
  export PYTHONUNBUFFERED=1
  OUT=${OUT:-bench_out}; mkdir -p "$OUT"; W=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$W/pip.log" 2>&1 || export PYTHONPATH=$PWD
  python3 -c "import torch, transformers, importlib.metadata as m
def v(p):
    try: return m.version(p)
    except Exception: return 'absent'
print('torch', torch.__version__, 'transformers', transformers.__version__, 'flash-attn-4', v('flash-attn-4'), 'liger-kernel', v('liger-kernel'), torch.cuda.get_device_name(), 'x', torch.cuda.device_count())" | tee "$W/env_phase$PHASE.txt"
}
bench() { python3 -m hf_blockdiag_cp.bench "$@"; }
session_end() {
  for f in "$W"/*.log; do echo "=== $f"; grep -E "$1" "$f" | tail -25; done
  tar -czf "$OUT/results_phase$PHASE.tgz" -C "$W" .
  ls -la "$OUT"
}
