"""Long packs on one GPU, 8B-class models: the longest pack that trains a step, and tokens/s at fixed
lengths, through `BlockdiagCPTrainer` (cp_size=1), random init from the real configs' shapes
(`memory_bound.MODELS`: Llama-3.1-8B, Qwen3-8B, a Qwen3.5-9B-class hybrid; no downloads), exact per
document, bf16.

    timeout 590 python benchmarks/long_pack.py --models llama3_8b --methods full --offload-checkpoints \\
        --find-longest --start 131072 --budget-s 560 --out bench_out/long_pack          # one H200
    timeout 590 python benchmarks/long_pack.py --models llama3_8b --methods full lora --offload-checkpoints \\
        --lengths 131072 --steps 2 --budget-s 560 --out bench_out/long_pack
    python benchmarks/long_pack.py --tiny --find-longest --start 512 --granularity 256 --oom-above 1000 \\
        --lengths 512 --out /tmp/long_pack_tiny                                        # CPU smoke check, < 1 min

On the GPU machine: packages from shared/device/activate.sh (FA4, Liger, fla), the repository root on
PYTHONPATH. The memory bound these runs are measured against: benchmarks/memory_bound.py.

Each probe (one model, method and pack length) runs in a fresh subprocess of this script: a CUDA
out-of-memory error inside a backward with offloaded checkpoints and FSDP2 leaves pinned host blocks,
the caching allocator's segments and half-run autograd state behind, and the host memory peak
(`ru_maxrss`) only ever grows within a process; a fresh process gives every probe a clean GPU and its
own host peak, at the cost of the imports and the model's construction (excluded from the step times).

A probe: the model built on the GPU (`--precision bf16`: bf16 weights, gradients and AdamW moments,
TrainingArguments.bf16 off; `mixed`: fp32 weights under bf16 autocast), non-reentrant activation
checkpointing enabled on the model (not in the TrainingArguments: the Trainer would enable it again and
drop the offload), then the switches: `--tiled-mlp TILE` (`enable_tiled_mlp`, default 16384; 0 off),
`--offload-checkpoints` (`enable_checkpoint_offload`), `--fused-ce` (Liger's fused linear cross-entropy,
the chunked head; on by default where it runs), `--fsdp-offload` (FSDP2's `CPUOffloadPolicy` through
`TrainingArguments(fsdp=True, fsdp_config={"version": 2, "cpu_offload": True})`; the process joins as
rank 0 of 1, as `torchrun --nproc-per-node 1` would), LoRA (`--methods lora`: PEFT r=16 on q/k/v/o and
gate/up/down, alpha 32). One pack per step: its documents' lengths log-normal (mean --mean-doc-len,
sigma 1) summing to exactly the pack length (`--single-doc`: one document), random token ids; the
optimizer `adamw_torch_fused` (`adamw_torch` with --tiny), lr 1e-5, clipping at 1; steps timed by a
callback syncing CUDA at `on_step_begin` / `on_step_end` (the optimizer step included), the first step
untimed.

Modes: `--lengths`: each length trains 1 + --steps steps; `--find-longest`: one step per probe (and
--probe-steps timed ones: an 8B step at 400K tokens takes about a minute), the length doubling from --start until a probe fails, then bisecting between the last length that trained
and the first that did not, down to --granularity tokens. A probe fails on CUDA or pinned-host out of
memory, or when the kernel kills it (host memory); any other error ends the search and is reported.
`--oom-above N` makes probes above N tokens fail as out of memory (exercises the search on the CPU).

Row columns: model, method, switches, tokens, docs, status, first_s (first step: compilation, FA4 and
fla autotuning), step_s (median of the timed steps; none timed, no rate), tokens_per_s, mfu (model FLOPs per step over the
step time and the GPU's dense bf16 peak, --peak-tflops, default 989 on H100/H200: 6 FLOPs per matmul
weight and token for a full fine-tune, 4 for LoRA (no base weight gradients), plus attention's
block-causal FLOPs as docs/performance.md counts them (`bench.common.attention_flops`: forward 4·H·D
per causal pair, fwd+bwd 3.5x); the gated delta rule's own FLOPs not counted), peak_gpu_gib
(max_memory_allocated; reserved_gpu_gib in the JSON), host_gib (peak RSS of the probe's process, pinned memory included). A line per
probe is printed (flushed); <out>/long_pack.json and .md are written after every probe; a probe
starts only if expected to end within --budget-s (a cut run keeps what it measured).
"""

from __future__ import annotations

# ruff: noqa: E402  (the clock starts before the imports)
import time

STARTED = time.time()  # --budget-s counts from here

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_bound import LORA_RANK, LORA_TARGETS, MODELS, build_config

COLUMNS = ["model", "method", "switches", "tokens", "docs", "status", "first_s", "step_s", "tokens_per_s", "mfu",
           "peak_gpu_gib", "host_gib"]
TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_hidden_layers=2)
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   num_hidden_layers=4)  # the fourth layer is the first full-attention one
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16, SXM
PROBE_OVERHEAD_S = 60.0  # a probe besides its steps: imports, model construction, pinned allocations


def log(message: str) -> None:
    print(f"[long_pack {time.time() - STARTED:6.1f} s] {message}", flush=True)


def switches(args) -> str:
    on = [f"tiled-mlp {args.tiled_mlp}" if args.tiled_mlp else "", "offload-checkpoints" * args.offload_checkpoints,
          "fsdp-offload" * args.fsdp_offload, "fused-ce" * (args.fused_ce == "on"), "single-doc" * args.single_doc,
          "fp32" if args.tiny else args.precision]
    return ", ".join(s for s in on if s)


# --------------------------------------------------------------------------- one probe (child process)


def model_config(name: str, tiny: bool):
    overrides = dict(use_cache=False)
    if tiny:
        overrides |= TINY | (TINY_LINEAR if name == "qwen3_5_9b" else {})
    return build_config(name, **overrides)


def pack_lengths(tokens: int, args) -> list[int]:
    from hf_blockdiag_cp.bench.common import lognormal_lengths

    return [tokens] if args.single_doc else lognormal_lengths(tokens, args.mean_doc_len, seed=args.seed)


def model_flops(model, config, lengths: list[int], lora: bool) -> float:
    """Model FLOPs of one step (module docstring): matmul weights x tokens, plus block-causal attention."""
    import torch

    from hf_blockdiag_cp.bench.common import attention_flops

    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    attention = sum(k == "full_attention" for k in kinds) * attention_flops(lengths, config.num_attention_heads,
                                                                              config.head_dim)
    return (4 if lora else 6) * weights * sum(lengths) + attention


def build_model(name: str, args):
    """The model on the device with checkpointing on and the memory switches; (model, model FLOPs function)."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_blockdiag_cp as bdcp
    from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
    from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy

    config = model_config(name, args.tiny)
    dtype = torch.float32 if args.tiny or args.precision == "mixed" else torch.bfloat16
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="blockdiag_cp")
    enable_activation_checkpointing(model, use_reentrant=False)
    if args.tiled_mlp:
        bdcp.enable_tiled_mlp(model, tile_tokens=args.tiled_mlp)
    if args.offload_checkpoints:
        bdcp.enable_checkpoint_offload(model)
    if args.fused_ce == "on":
        enable_fused_cross_entropy(model)  # says once where it cannot run (no CUDA or no Liger)
    flops = lambda lengths: model_flops(model, config, lengths, args.method == "lora")  # noqa: E731 (before LoRA)
    if args.method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                                 target_modules=list(LORA_TARGETS)))
    return model, flops


def join_as_one_process() -> None:
    """Rank 0 of 1, as `torchrun --nproc-per-node 1` sets it: accelerate runs FSDP only when launched."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)


def training_args(args, out: str, steps: int):
    import torch
    from transformers import TrainingArguments

    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "cpu_offload": True}) if args.fsdp_offload else {}
    if args.fsdp_offload:
        join_as_one_process()
    targs = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=1,
        optim=args.optim, learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=args.device == "cpu", seed=args.seed, disable_tqdm=True,
        bf16=args.precision == "mixed" and not args.tiny, dataloader_num_workers=0, **fsdp)
    if args.fsdp_offload and not torch.cuda.is_available():  # pinning host memory needs CUDA
        from torch.distributed.fsdp import CPUOffloadPolicy

        targs.fsdp_plugin_args["cpu_offload"] = CPUOffloadPolicy(pin_memory=False)
    return targs


def step_timer():
    import torch
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    class StepTimer(TrainerCallback):
        """Seconds of every optimizer step, CUDA synced at both ends."""

        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            self.times.append(time.perf_counter() - self.t0)

    return StepTimer()


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def probe(spec: dict) -> dict:
    """Train 1 + steps steps on packs of `tokens` tokens; the row (status ok, oom or error)."""
    import resource
    import statistics
    import tempfile

    import torch
    from transformers import PrinterCallback

    from hf_blockdiag_cp import CPConfig
    from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer

    args = argparse.Namespace(**spec)
    tokens, cuda = args.tokens, args.device == "cuda"
    lengths = pack_lengths(tokens, args)
    row = dict(model=args.model, method=args.method, switches=switches(args), tokens=tokens, docs=len(lengths))
    try:
        if args.oom_above and tokens > args.oom_above:
            raise torch.OutOfMemoryError(f"--oom-above {args.oom_above}: a simulated out of memory")
        model, flops = build_model(args.model, args)
        g = torch.Generator().manual_seed(args.seed)
        vocab = model.config.vocab_size
        data = [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in lengths] * (1 + args.steps)
        timer = step_timer()
        with tempfile.TemporaryDirectory() as out:
            trainer = BlockdiagCPTrainer(model=model, args=training_args(args, out, 1 + args.steps), train_dataset=data,
                                         cp_size=1, max_tokens=tokens, packing_buffer_size=len(lengths), shuffle=False,
                                         cp_config=CPConfig(attn_backend=args.attn_backend), callbacks=[timer])
            trainer.remove_callback(PrinterCallback)
            if args.fsdp_offload and not trainer.is_fsdp_enabled:
                raise RuntimeError("--fsdp-offload: the Trainer does not run FSDP (accelerate runs it on accelerators only)")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
        if trainer.cp_tokens_trained != tokens * (1 + args.steps):
            raise RuntimeError(f"trained {trainer.cp_tokens_trained} tokens; expected {1 + args.steps} packs of {tokens}")
        row.update(status="ok", first_s=timer.times[0], timed=len(timer.times) - 1)
        if len(timer.times) > 1:  # the first step compiles and autotunes: no rate from it
            step_s = statistics.median(timer.times[1:])
            peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()),
                                            None) if cuda else None
            row.update(step_s=step_s, tokens_per_s=tokens / step_s,
                       mfu=flops(lengths) / step_s / (peak * 1e12) if peak else None)
    except Exception as error:  # noqa: BLE001 - every probe reports; the search reads the status
        row.update(status="oom" if out_of_memory(error) else "error", error=f"{type(error).__name__}: {str(error)[:300]}")
    if cuda:
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["reserved_gpu_gib"] = torch.cuda.max_memory_reserved() / 2**30
    row["host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


# --------------------------------------------------------------------------- the search (parent process)


def run_probe(args, result: dict, model: str, method: str, tokens: int, steps: int) -> dict:
    """One probe in a fresh process of this script (module docstring says why); its row, also saved."""
    spec = {**vars(args), "model": model, "method": method, "tokens": tokens, "steps": steps}
    left = STARTED + args.budget_s - time.time()
    cmd = [sys.executable, __file__, "--probe", json.dumps(spec)]
    row = dict(model=model, method=method, switches=switches(args), tokens=tokens)
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.DEVNULL,
                              text=True, timeout=max(1.0, left))
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
        if lines:
            row = json.loads(lines[-1][4:])
        else:  # killed: by the kernel (host memory) as a rule
            row.update(status="oom" if done.returncode in (-9, 137) else "error",
                       error=f"probe exited {done.returncode} without a row")
    except subprocess.TimeoutExpired:
        row.update(status="budget", error="--budget-s ran out during the probe")
    result["rows"].append(row)
    save(args, result)
    log(" ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS if row.get(c) is not None) +
        (f" ({row['error']})" if row.get("error") else ""))
    return row


def fits_budget(args, rows: list[dict], tokens: int, steps: int) -> bool:
    """Whether a probe of `tokens` is expected to end within --budget-s (the last probe's times scaled)."""
    done = [r for r in rows if r.get("first_s")]
    if not done:
        return time.time() + PROBE_OVERHEAD_S < STARTED + args.budget_s
    last = done[-1]
    scale = tokens / last["tokens"]
    expected = PROBE_OVERHEAD_S + (last["first_s"] + steps * (last.get("step_s") or last["first_s"])) * scale
    return time.time() + expected < STARTED + args.budget_s


def find_longest(args, result: dict, model: str, method: str) -> None:
    """Doubling from --start until a probe fails, then bisecting down to --granularity tokens."""
    entry = result["longest"].setdefault(f"{model} {method} ({switches(args)})", {"trained": None, "failed": None})
    rows: list[dict] = []
    tokens, low, high = args.start, None, None
    while True:
        if high is not None:
            if low is None or high - low <= args.granularity:
                break
            tokens = (low + high) // 2 // args.granularity * args.granularity
            if tokens <= low:
                break
        if not fits_budget(args, rows, tokens, args.probe_steps):
            entry["stopped"] = f"budget before {tokens}"
            break
        row = run_probe(args, result, model, method, tokens, steps=args.probe_steps)
        rows.append(row)
        if row["status"] == "ok":
            low = tokens
            if high is None:
                tokens *= 2
        elif row["status"] == "oom":
            high = tokens
        else:
            entry["stopped"] = f"{row['status']} at {tokens}"
            break
        entry.update(trained=low, failed=high)
        save(args, result)


def time_lengths(args, result: dict, model: str, method: str) -> None:
    rows: list[dict] = []
    for tokens in args.lengths:
        if not fits_budget(args, rows, tokens, args.steps):
            log(f"skipped {model} {method} {tokens}: over --budget-s")
            continue
        rows.append(run_probe(args, result, model, method, tokens, steps=args.steps))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def save(args, result: dict) -> None:
    from hf_blockdiag_cp.bench.common import markdown_table, write_json

    write_json(f"{args.out}/long_pack.json", {"args": vars(args), **result})
    longest = [{"model_method": k, **v} for k, v in result["longest"].items()]
    with open(f"{args.out}/long_pack.md", "w") as f:
        f.write(markdown_table(result["rows"], COLUMNS) + "\n\n" +
                markdown_table(longest, ["model_method", "trained", "failed", "stopped"]) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["llama3_8b"])
    p.add_argument("--methods", nargs="+", choices=["full", "lora"], default=["full"])
    p.add_argument("--find-longest", action="store_true", help="search the longest pack that trains a step")
    p.add_argument("--start", type=int, default=131072, help="--find-longest: the first length tried")
    p.add_argument("--granularity", type=int, default=32768, help="--find-longest: bisect down to this many tokens")
    p.add_argument("--lengths", type=int, nargs="*", default=[], help="time these pack lengths")
    p.add_argument("--steps", type=int, default=2, help="--lengths: timed steps after the first")
    p.add_argument("--probe-steps", type=int, default=0, help="--find-longest: timed steps after each probe's first")
    p.add_argument("--tiled-mlp", type=int, default=None, help="enable_tiled_mlp's tile_tokens (16384; 128 with "
                   "--tiny); 0: off")
    p.add_argument("--offload-checkpoints", action="store_true", help="enable_checkpoint_offload")
    p.add_argument("--fsdp-offload", action="store_true", help="FSDP2 CPUOffloadPolicy through the TrainingArguments")
    p.add_argument("--fused-ce", choices=["on", "off"], default="on", help="Liger's fused linear cross-entropy")
    p.add_argument("--precision", choices=["bf16", "mixed"], default="bf16",
                   help="bf16: bf16 weights, gradients and moments; mixed: fp32 weights under bf16 autocast")
    p.add_argument("--single-doc", action="store_true", help="one document per pack")
    p.add_argument("--mean-doc-len", type=float, default=None, help="2048 (64 with --tiny)")
    p.add_argument("--attn-backend", default="auto", help="CPConfig.attn_backend (auto: FA4 where available)")
    p.add_argument("--optim", default=None, help="default adamw_torch_fused (adamw_torch with --tiny)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak for MFU")
    p.add_argument("--budget-s", type=float, default=560.0, help="a probe starts only if expected to end in it")
    p.add_argument("--oom-above", type=int, default=None, help="probes above this many tokens fail as out of memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy configs, CPU, fp32: a smoke check")
    p.add_argument("--verbose", action="store_true", help="the probes' stderr too")
    p.add_argument("--out", default="bench_out/long_pack")
    args = p.parse_args(argv)
    if not args.find_longest and not args.lengths:
        p.error("give --find-longest and/or --lengths")
    if args.tiny and args.fsdp_offload:
        p.error("--fsdp-offload needs CUDA: accelerate runs FSDP on accelerator devices only")
    args.device = "cpu" if args.tiny else "cuda"
    args.tiled_mlp = (128 if args.tiny else 16384) if args.tiled_mlp is None else args.tiled_mlp
    args.mean_doc_len = args.mean_doc_len or (64.0 if args.tiny else 2048.0)
    args.optim = args.optim or ("adamw_torch" if args.tiny else "adamw_torch_fused")
    return args


def main(argv=None) -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        if json.loads(sys.argv[2]).get("tiny"):
            import torch

            torch.set_num_threads(1)  # toy matrices on a shared machine
        print("ROW " + json.dumps(probe(json.loads(sys.argv[2]))), flush=True)
        return
    args = parse_args(argv)
    from hf_blockdiag_cp.bench.common import environment

    result = {"env": environment(), "rows": [], "longest": {}}
    log(f"{result['env']}; switches: {switches(args)}")
    for model in args.models:
        for method in args.methods:
            if args.find_longest:
                find_longest(args, result, model, method)
            if args.lengths:
                time_lengths(args, result, model, method)
    save(args, result)
    with open(f"{args.out}/long_pack.md") as f:
        print(f.read(), flush=True)
    log(f"done; {args.out}/long_pack.json")


if __name__ == "__main__":
    main()
