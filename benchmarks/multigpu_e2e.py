"""The end-to-end part of benchmarks/multigpu.py: forward + backward of a Llama-architecture model
on packed batches at CP size G (and G = 1 for comparison), tokens/s per GPU, peak memory, and the
largest pack that trains (sizes ascending until one runs out of memory).

Each (model, size) runs in a child process group of its own (the same ranks, a fresh port), so a
rank that runs out of memory cannot leave its peers inside a collective of the main group: the
child writes its result and exits; a peer's parent sees the failure and ends its own child; the
out-of-memory flag is then all-reduced over the main group, so every rank decides alike.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.bench.setups import E2E_CONFIGS, e2e_pack_lengths
from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy, fused_cross_entropy_unavailable
from hf_blockdiag_cp.kernels import choose_kernel
from hf_blockdiag_cp.step import CPStep
from multigpu_lib import Ctx

SCRIPT = Path(__file__).resolve().with_name("multigpu.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _e2e_sizes(args) -> list[int]:
    sizes = sorted(args.e2e_tokens or ([256, 512, 1024] if args.tiny else [65536, 131072, 262144, 524288, 1048576]))
    while args.e2e_max_tokens and sizes[-1] * 2 <= args.e2e_max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


def part_e2e(ctx: Ctx, args) -> dict:
    """Every model at G = world size (and G = 1 on rank 0's GPU with `--e2e-single`), sizes ascending
    until one does not train; per-GPU rates against G = 1 where both ran."""
    rows = []
    deadline = time.time() + args.e2e_budget_s
    models = ["tiny"] if args.tiny else args.e2e_models
    sizes = _e2e_sizes(args)
    runs = [(m, ctx.world) for m in models]
    if ctx.world > 1 and args.e2e_single:
        runs += [(m, 1) for m in models]  # G = 1 on rank 0's GPU, for the per-GPU comparison
    largest = {}
    if ctx.rank == 0:  # results of an earlier run in the same directory would be read as this run's
        for stale in list((ctx.out / "raw").glob("e2e_*.json")) + list((ctx.out / "raw").glob("e2e_*.done")):
            stale.unlink(missing_ok=True)
    ctx.barrier()
    single_sizes = sorted(args.e2e_single_tokens) if args.e2e_single_tokens else sizes
    for model, G in runs:
        for S in (single_sizes if G == 1 and ctx.world > 1 and not args.tiny else sizes):
            if ctx.out_of_time(deadline):
                rows.append({"model": model, "G": G, "tokens": S, "status": "skipped: e2e time budget"})
                break
            row = _measure(ctx, args, model, G, S)
            if row["status"] == "ok":
                largest[f"{model} G={G}"] = S
            rows.append(row)
            ctx.save_partial(rows, E2E_COLUMNS)
            ctx.log("e2e", row)
            if row["status"] != "ok":
                break
    _add_vs_single(rows)
    return {"rows": rows, "columns": E2E_COLUMNS, "largest_pack_that_trains": largest}


def _measure(ctx: Ctx, args, model: str, G: int, S: int) -> dict:
    """One (model, G, size) in a child process group on ranks 0..G-1; every rank returns the same row."""
    port = int(ctx.reduce([_free_port() if ctx.rank == 0 else 0])[0])
    tag = f"e2e_{model}_G{G}_S{S}"
    res = {}
    if ctx.rank < G:
        try:
            res = _launch_child(ctx, args, dict(model=model, tokens=S, G=G, port=port, tag=tag))
        except Exception as exc:  # noqa: BLE001 - never skip the agreement below
            res = {"error": f"launching the child failed: {type(exc).__name__}: {exc}"}
    # Wait on the file system, not inside a collective: a child may outlast the NCCL timeout of this group.
    (ctx.out / "raw" / f"{tag}_rank{ctx.rank}.done").touch()
    _wait_files([ctx.out / "raw" / f"{tag}_rank{r}.done" for r in range(ctx.world)], args.e2e_child_timeout_s + 120)
    oom, err = bool(res.get("oom")), bool(res.get("error")) and not res.get("oom")
    red = ctx.reduce([oom, err, res.get("step_s", 0), res.get("peak_gib", 0), res.get("first_s", 0)])  # the same on every rank
    row = {"model": model, "G": G, "tokens": S, "docs": res.get("docs"), "kernel": res.get("kernel"),
           "fused_ce": args.e2e_fused_ce, "layout": args.e2e_layout if G > 1 else None,
           "grad_sync": args.e2e_grad_sync if G > 1 else None, "overlap": args.e2e_overlap if G > 1 else None}
    if red[0]:
        row["status"] = "OOM"
    elif red[1]:
        row.update(status="error", note=(res.get("error") or "failed on another rank")[:200])
    else:
        step_s = red[2]
        row.update(status="ok", step_s=step_s, first_s=red[4], tokens_per_s=S / step_s,
                   tokens_per_s_per_gpu=S / step_s / G, peak_gib=red[3])
    return row


def _add_vs_single(rows: list[dict]) -> None:
    """Per-GPU tokens/s at G over G = 1 on the same pack, and over G = 1 on a pack of the same tokens per GPU."""
    g1 = {(r["model"], r["tokens"]): r.get("tokens_per_s_per_gpu") for r in rows if r["G"] == 1 and r.get("status") == "ok"}
    for r in rows:
        if r["G"] == 1 or not r.get("tokens_per_s_per_gpu"):
            continue
        for column, tokens in (("per_gpu_vs_G1", r["tokens"]), ("per_gpu_vs_G1_same_per_gpu", r["tokens"] // r["G"])):
            base = g1.get((r["model"], tokens))
            if base:
                r[column] = r["tokens_per_s_per_gpu"] / base


E2E_COLUMNS = ["model", "G", "tokens", "docs", "kernel", "fused_ce", "layout", "grad_sync", "overlap", "status", "first_s", "step_s",
               "tokens_per_s", "tokens_per_s_per_gpu", "per_gpu_vs_G1", "per_gpu_vs_G1_same_per_gpu", "peak_gib", "note"]


def _launch_child(ctx: Ctx, args, job: dict) -> dict:
    """Run one (model, size) fwd+bwd measurement in a fresh process group of job['G'] ranks."""
    raw = ctx.out / "raw"
    result = raw / f"{job['tag']}_rank{ctx.rank}.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ, RANK=str(ctx.rank), WORLD_SIZE=str(job["G"]), LOCAL_RANK=str(ctx.local_rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), LOCAL_WORLD_SIZE=str(job["G"]))
    for k in list(env):  # torchrun's agent store would make the child a client of a store nobody serves
        if k.startswith("TORCHELASTIC_") or k in ("GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE"):
            env.pop(k)
    cmd = [sys.executable, str(SCRIPT), "--e2e-child", json.dumps({**job, "result": str(result)}),
           "--out", str(ctx.out), "--device", args.device, "--timeout-s", str(args.e2e_child_timeout_s),
           "--steps", str(args.steps), "--e2e-kernel", args.e2e_kernel, "--e2e-layout", args.e2e_layout,
           "--e2e-grad-sync", args.e2e_grad_sync] + (["--e2e-overlap", args.e2e_overlap] if args.e2e_overlap else [])
    cmd += (["--e2e-fused-ce"] if args.e2e_fused_ce else []) + (["--tiny"] if args.tiny else [])
    cmd += [] if args.checkpointing else ["--no-checkpointing"]
    with open(raw / f"{job['tag']}_rank{ctx.rank}.log", "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        t0 = time.time()
        while proc.poll() is None:
            time.sleep(0.5)
            # a peer that OOMed or failed has exited; do not wait for the collective timeout
            if _peer_failed(raw, job, ctx.rank) or time.time() - t0 > args.e2e_child_timeout_s + 60:
                time.sleep(5)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                break
    if result.exists():
        return json.loads(result.read_text())
    return {"error": f"child exited with {proc.returncode} without a result (see raw/{job['tag']}_rank{ctx.rank}.log)"}


def _wait_files(paths: list[Path], limit_s: float) -> None:
    t0 = time.time()
    while not all(p.exists() for p in paths) and time.time() - t0 < limit_s:
        time.sleep(0.2)


def _peer_failed(raw: Path, job: dict, rank: int) -> bool:
    for r in range(job["G"]):
        p = raw / f"{job['tag']}_rank{r}.json"
        if r != rank and p.exists():
            try:
                if not json.loads(p.read_text()).get("ok"):
                    return True
            except (OSError, ValueError):
                pass
    return False


def _kernel_name(step: CPStep, model) -> str:
    """The kernel `auto` resolves to for this model's attention layers (as attention.dispatch chooses it)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    return choose_kernel(step.attn_backend, step.plan.q_positions.device, dtype, head_dim, head_dim, frozenset()).name


def _child_model(args, job: dict, device, group):
    """The job's model on `device` in bf16 (fp32 on CPU), checkpointing and fused CE as asked, wrapped
    in DDP over the CP group with `--e2e-grad-sync ddp` (the README's recipe)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cuda = device.type == "cuda"
    config = LlamaConfig(**E2E_CONFIGS[job["model"]])
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="blockdiag_cp")
    model.to(device).train()
    if args.checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    if args.e2e_fused_ce and not enable_fused_cross_entropy(model):
        raise RuntimeError(f"--e2e-fused-ce: {fused_cross_entropy_unavailable(model)}")
    if group is not None and args.e2e_grad_sync == "ddp":  # bucketed all-reduces overlapped with backward
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device] if cuda else None, process_group=group,
                                        gradient_as_bucket_view=True)
    return model


def _timed_steps(args, model, batch: dict, group, rank: int, G: int, out: dict) -> list[float]:
    """1 + `--steps` training steps (shard step and planning included), seconds each; the CP gradient
    all-reduce per parameter after backward (exposed) unless DDP synchronises."""
    cuda = batch["input_ids"].is_cuda
    ddp = hasattr(model, "module")
    cp_config = bdcp.CPConfig(attn_backend=args.e2e_kernel, kv_exchange="allgather", layout=args.e2e_layout,
                              overlap=args.e2e_overlap)
    fake_oom = batch["input_ids"].shape[1] >= int(os.environ.get("MULTIGPU_FAKE_OOM_TOKENS", 1 << 62))
    times = []
    for _ in range(1 + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=cp_config)
        with train_ctx() as step:
            out["kernel"] = _kernel_name(step, model.module if ddp else model)
            if fake_oom and rank == G - 1:  # testing hook: one rank fails mid-step, the others are in a collective
                raise torch.OutOfMemoryError("MULTIGPU_FAKE_OOM_TOKENS")
            model(**local).loss.backward()
        if group is not None and not ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def e2e_child(args) -> None:
    """One fwd+bwd measurement; writes a JSON result and exits without tearing the group down."""
    job = json.loads(args.e2e_child)
    out: dict = {"ok": False}
    try:
        cuda = args.device == "cuda"
        rank, G = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        group = None
        if G > 1:
            kw = {"device_id": device} if cuda else {}
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s), **kw)
            group = dist.group.WORLD
        model = _child_model(args, job, device, group)
        S = job["tokens"]
        lengths = e2e_pack_lengths(S)
        ids = torch.randint(0, E2E_CONFIGS[job["model"]]["vocab_size"], (1, S), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids.to(device), "labels": ids.clone().to(device),
                 "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device)}
        out["docs"] = len(lengths)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = _timed_steps(args, model, batch, group, rank, G, out)
        out.update(ok=True, first_s=times[0], step_s=statistics.median(times[1:]), step_times=times,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    except torch.OutOfMemoryError as exc:
        out.update(oom=True, error=str(exc)[:300])
    except Exception as exc:  # noqa: BLE001
        out.update(error=f"{type(exc).__name__}: {exc}"[:500], traceback=traceback.format_exc())
    print(json.dumps({k: v for k, v in out.items() if k != "traceback"}), flush=True)
    tmp = Path(job["result"] + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(job["result"])
    os._exit(0)  # no destroy_process_group: peers may be stuck in a collective after an OOM here
