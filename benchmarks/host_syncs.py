"""Host-device synchronisations of one training step (forward + backward) of ours, per call site.

    python benchmarks/host_syncs.py --out /tmp/host_syncs.json                  # CPU: Llama, DPO and SFT, cp 1 and 2
    python benchmarks/host_syncs.py --models qwen3_5 --cp 1 --out ...   # the Qwen3.5 hybrid (gated delta rule)
    python benchmarks/host_syncs.py --tasks dpo_trainer sft_trainer --cp 1 --out ...   # the TRL trainers' step

A step is the core step API as a trainer runs it, on a tiny model (random init, fp32; bf16 on CUDA): the pack collated
and sharded on the host (`BlockdiagCPCollator`, `PairPackCollator`: host work by design, not counted),
its tensors moved to the model's device, `make_cp_blockdiag_batch_and_ctx`, then inside `train_ctx()`:
SFT, `model(**local).loss` and its backward (`sft_full_pack`: the full pack moved to the device and
sharded inside `make_cp_blockdiag_batch_and_ctx`, which reads it back to plan); DPO (2 pairs per pack), the policy's and the reference's
`document_log_probs` (the chunked log-prob head) and the sigmoid loss of the pairs' sums, and its
backward. `dpo_trainer`, `sft_trainer`: `BlockdiagCPDPOTrainer` / `BlockdiagCPSFTTrainer.training_step` (4
pairs or 4 documents in one pack; forward, backward and the trainer's metrics, not the optimizer), cp 1 only. cp 2 runs two gloo ranks (rank 0 reported; the
ranks run the same code). The first step warms up (one-time probes, caches), the second is counted.

Counted, in two ways:
- On CUDA, `torch.cuda.set_sync_debug_mode("warn")`: every synchronising CUDA call that torch makes warns;
  their total is reported beside the op counts (the ops' device is then read from the tensors).
- On any device, a TorchDispatchMode (with a TorchFunctionMode beside it) counts the operations that
  force a host-device sync on a GPU when their input lives on the model's device: `aten._local_scalar_dense`
  (`.item()`, `int()`, `bool()`, `float()`, indexing a list), `nonzero`, `masked_select`, `equal`, `bincount`,
  `unique*`, `repeat_interleave` without `output_size`, indexing or `index_put` with a boolean mask, a copy
  to the host (`.cpu()`, `.to("cpu")`, `.tolist()`, `.numpy()`, `copy_` into a host tensor); and, apart
  (not syncs, but each a `cudaMemcpyAsync` of host time), copies from the host to the device. Each is
  reported with the innermost Python frame in this package (file:line) and the innermost frame outside
  torch (which may be Transformers'), or the autograd node in a backward.

Which tensors "live on the device" on a CPU run: the model's parameters and buffers, the batch tensors
the benchmark moves to the device, and, propagated by the dispatch mode, everything an operation makes
from one of them (tagged by storage, so views and autograd's saved tensors keep their tag); a factory
call or `.to()` given a device read from a device tensor (`t.device`, which the function mode answers
with the marker device `cpu:0`) or `cpu:0` itself makes a device tensor; `.cpu()`, `.to("cpu")` and a
`torch.device("cpu")` make host tensors. Limits of the CPU count:
- a host tensor created with `device=<host tensor>.device` is a host tensor (as on a GPU), but one created
  with a device object built elsewhere (`torch.device("cpu", 0)`) would count as a device tensor;
- collectives run on gloo, and nothing inside a torch.distributed call is counted: the consensus
  all-reduce's `.cpu()` on an NCCL group (one per step at cp > 1, by design) and a backend's own syncs
  are not seen; neither are kernels that sync internally (a varlen kernel
  reading `cu_seqlens` on the host, FA4's setup), the CUDA caching allocator, nor pinned-memory effects;
- code that branches on `device.type == "cuda"` takes its CPU branch (e.g. the head's eager tiles).
On CUDA only the placement rules fall away: the ops counted are the same, read from the tensors' device.

Output: a table per scenario (op, our call site, count per step, the outer site) to stdout; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hf_blockdiag_cp
from hf_blockdiag_cp import BlockdiagCPCollator, CPConfig, document_log_probs, make_cp_blockdiag_batch_and_ctx

PACKAGE = str(Path(hf_blockdiag_cp.__file__).resolve().parent) + os.sep
PATCHES = str(Path(hf_blockdiag_cp.__file__).resolve().parent.parent / "model_patches") + os.sep
HERE = os.path.abspath(__file__)
DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
COUNTER_FRAMES = {"call_sites", "record", "__torch_function__", "__torch_dispatch__", "_count", "_host_clone"}
DEVICE_GETTER = torch.Tensor.device.__get__
MARKER = torch.device("cpu", 0)  # what `t.device` of a device tensor reads as on a CPU run
aten = torch.ops.aten

# Operations that read device memory back to the host (or size an output by device data) on a GPU.
SYNC_OPS = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.equal.default: "equal",
    aten.bincount.default: "bincount",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim_consecutive.default: "unique",
}
INDEX_OPS = {aten.index.Tensor: "bool-mask index", aten.index_put.default: "bool-mask index_put",
             aten.index_put_.default: "bool-mask index_put", aten._index_put_impl_.default: "bool-mask index_put"}
REPEAT_INTERLEAVE = aten.repeat_interleave.Tensor
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.linspace, torch.randn, torch.rand, torch.randint, torch.eye, torch.zeros_like, torch.ones_like,
             torch.empty_like, torch.full_like, torch.randn_like, torch.rand_like, torch.tensor}
HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "numpy"}


def _short(path: str) -> str:
    for root, name in ((PACKAGE, "hf_blockdiag_cp/"), (PATCHES, "model_patches/")):
        if path.startswith(root):
            return name + path[len(root):]
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


def call_sites(stack) -> tuple[str, str]:
    """(innermost frame in this package or its model patches, innermost frame outside torch and this file)."""
    ours = outer = None
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if (path == HERE and frame.name in COUNTER_FRAMES) or f"{os.sep}torch{os.sep}" in path or path.startswith("<"):
            continue
        site = f"{_short(path)}:{frame.lineno} ({frame.name})"
        outer = outer or site
        if path.startswith((PACKAGE, PATCHES)):
            ours = site
            break
    if ours is None and outer is None:
        node = torch._C._current_autograd_node()
        outer = f"backward of {type(node).__name__}" if node is not None else "(no Python frame)"
    return ours or "(not ours)", outer or "(none)"


class SyncCounter:
    """Count the ops that would synchronise host and device on a GPU, per call site (module docstring)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.device_storages: dict[int, object] = {}  # storage id -> storage (held: no address reuse)
        self.counts: Counter = Counter()
        self.copies: Counter = Counter()  # host -> device copies (not syncs)
        self.counting = False
        self._outer = self._dispatch = None

    # -- which tensors are on the device
    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.cuda:
            return t.device.type == "cuda"
        try:
            return t.untyped_storage().data_ptr() in self.device_storages
        except (RuntimeError, NotImplementedError):
            return False

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor) and not self.cuda:
            storage = t.untyped_storage()
            self.device_storages[storage.data_ptr()] = storage

    def mark_module(self, module: torch.nn.Module) -> None:
        for t in list(module.parameters()) + list(module.buffers()):
            self.mark(t)

    def record(self, op: str, table: Counter | None = None) -> None:
        if not self.counting:
            return
        stack = traceback.extract_stack()
        if any(DISTRIBUTED in frame.filename for frame in stack):
            return  # inside a torch.distributed call: gloo's own host copies, none on NCCL
        (self.counts if table is None else table)[(op, *call_sites(stack))] += 1

    # -- modes
    def __enter__(self):
        self._outer, self._dispatch = _FunctionMode(self), _DispatchMode(self)
        self._outer.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc):
        self._dispatch.__exit__(*exc)
        self._outer.__exit__(*exc)


def _device_arg(value) -> bool | None:
    """True: the model's device; False: the host; None: no device named."""
    if value is None:
        return None
    if isinstance(value, str):
        value = torch.device(value)
    if isinstance(value, torch.device):
        return value.type != "cpu" or value.index is not None
    return None


def _to_target(counter: SyncCounter, args, kwargs) -> bool | None:
    """Where `Tensor.to(*args, **kwargs)` sends its tensor (True: device, False: host, None: stays)."""
    if "device" in kwargs:
        return _device_arg(kwargs["device"])
    for value in args[1:2]:
        if isinstance(value, torch.Tensor):
            return counter.on_device(value) if not counter.cuda else value.device.type == "cuda"
        if isinstance(value, (str, torch.device)):
            return _device_arg(value)
    return None


class _FunctionMode(TorchFunctionMode):
    """Device placement on a CPU run (factories, `.to()`, `.cpu()`, `t.device`) and host reads (`tolist`)."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if func in HOST_READS and c.on_device(args[0]):
            c.record(HOST_READS[func])
        if c.cuda:
            return func(*args, **kwargs)
        if func == DEVICE_GETTER:
            return MARKER if c.on_device(args[0]) else torch.device("cpu")
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            target = {torch.Tensor.cpu: False, torch.Tensor.cuda: True}.get(func)
            target = _to_target(c, args, kwargs) if target is None else target
            source = args[0]
            if func is not torch.Tensor.cuda:
                out = func(*args, **kwargs)
            else:
                out = source.clone()
            if target and c.on_device(source) and out.dtype == source.dtype and not kwargs.get("copy"):
                return source  # already on the device: the same tensor, as on a GPU (`cpu:0` would copy)
            if target is None or target == c.on_device(source):
                return out
            if target:
                c.record("host->device copy", c.copies)
            else:
                c.record("device->host copy" + (" (non_blocking)" if kwargs.get("non_blocking") else ""))
            if out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
                out = out.clone() if target else _host_clone(c, out)
            if target:
                c.mark(out)
            return out
        out = func(*args, **kwargs)
        if func in FACTORIES and _device_arg(kwargs.get("device")):
            c.mark(out)
        return out


def _host_clone(counter: SyncCounter, t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in a fresh (host) storage, not tagged by the dispatch mode."""
    out = t.clone()
    counter.device_storages.pop(out.untyped_storage().data_ptr(), None)
    return out


class _DispatchMode(TorchDispatchMode):
    """Propagates the device tag (CPU runs) and counts the syncing ops on device inputs."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if func.namespace in ("c10d", "_c10d_functional"):  # a collective's own copies (gloo's): none counted
            counting, c.counting = c.counting, False
            try:
                return func(*args, **kwargs)
            finally:
                c.counting = counting
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        device = [c.on_device(t) for t in tensors]
        if any(device):
            self._count(func, args, kwargs)
        elif c.cuda and func is aten._to_copy.default and _device_arg(kwargs.get("device")) and tensors:
            c.record("host->device copy", c.copies)
        out = func(*args, **kwargs)
        if not c.cuda and any(device) and func is not aten.copy_.default:
            outs, _ = tree_flatten(out)
            for t in outs:
                if isinstance(t, torch.Tensor) and not (t.is_sparse or t.is_nested):
                    c.mark(t)
        return out

    def _count(self, func, args, kwargs) -> None:
        c = self.c
        if func in SYNC_OPS:
            c.record(SYNC_OPS[func])
        elif func is REPEAT_INTERLEAVE and kwargs.get("output_size") is None and (len(args) < 2 or args[1] is None):
            c.record("repeat_interleave (no output_size)")
        elif func in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and c.on_device(i) for i in indices or ()):
                c.record(INDEX_OPS[func])
        elif func is aten._to_copy.default and c.cuda and _device_arg(kwargs.get("device")) is False:
            c.record("device->host copy" + (" (non_blocking)" if kwargs.get("non_blocking") else ""))
        elif func is aten.copy_.default and isinstance(args[1], torch.Tensor):
            dst, src = c.on_device(args[0]), c.on_device(args[1])
            if src and not dst:
                c.record("device->host copy")
            elif dst and not src:
                c.record("host->device copy", c.copies)


# --------------------------------------------------------------------------- the models and steps


def tiny_model(family: str, attn: str = "blockdiag_cp") -> torch.nn.Module:
    """A tiny random model of `family` ("llama", "qwen3_5"): 4 layers, head dim 64 (what the GPU kernels take)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, pad_token_id=0, tie_word_embeddings=False)
    if family == "llama":
        config = LlamaConfig(**base)
    elif family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        config = Qwen3_5TextConfig(**base, layer_types=["linear_attention", "full_attention"] * 2,
                                   linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                   linear_num_key_heads=2, linear_num_value_heads=4)
    else:
        raise ValueError(f"--models: unknown family {family!r}; expected llama or qwen3_5")
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def documents(count: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length - (7 * i) % (length // 2),), generator=g) for i in range(count)]


def to_device(local: dict, device, counter: SyncCounter) -> dict:
    """The batch moved to the model's device, as the Trainer moves it (`_prepare_inputs`)."""
    out = {}
    for key, value in local.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device)
            counter.mark(value)
        out[key] = value
    return out


def sft_step(model, group, cp_size, rank, device, counter, seq_len, config, full_pack: bool = False) -> None:
    docs = documents(4, seq_len // 4, model.config.vocab_size, seed=1)
    collator = BlockdiagCPCollator(seq_len, 0, cp_size, rank, cp_config=config)
    examples = [{"input_ids": d} for d in docs]
    # sft_full_pack: the full pack on the device, sharded inside the step (the core API's other entry)
    local = to_device(collator.pack(examples) if full_pack else collator(examples), device, counter)
    counter.counting = True
    train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(group, None, local, config=config, model=model)
    with train_ctx():
        model(**local).loss.backward()
    counter.counting = False


def dpo_step(model, ref, group, cp_size, rank, device, counter, seq_len, config) -> None:
    from hf_blockdiag_cp.data.pairs import PAIRS_KEY, PairPackCollator, PromptCompletionPairs

    vocab = model.config.vocab_size
    prompts, completions = documents(2, seq_len // 8, vocab, 2), documents(4, seq_len // 8, vocab, 3)
    items = [(i, {"prompt_ids": prompts[i].tolist(), "chosen_ids": completions[2 * i].tolist(),
                  "rejected_ids": completions[2 * i + 1].tolist()}) for i in range(2)]
    collator = PairPackCollator(PromptCompletionPairs(), seq_len, 0, cp_size, rank, config)
    local = collator(items)
    pairs = local.pop(PAIRS_KEY)
    local = to_device(local, device, counter)
    counter.counting = True
    train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(group, None, local, config=config, model=model)
    with train_ctx():
        policy = document_log_probs(model, local).sums
        with torch.no_grad():
            reference = document_log_probs(ref, local).sums
        ratios = (policy - reference).view(pairs.pairs, 2)
        loss = -F.logsigmoid(0.1 * (ratios[:, 0] - ratios[:, 1])).mean()
        loss.backward()
    counter.counting = False


def word_tokenizer():
    """A three-token tokenizer: the pairs are pre-tokenized, the trainer only reads its pad and eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def dpo_trainer_steps(model, ref, group, cp_size, rank, device, counter, seq_len, config) -> None:
    """Two optimizer steps of `BlockdiagCPDPOTrainer` (4 pairs in one pack); the second step's `training_step`
    (forward, backward and the pair metrics; not the optimizer) is counted, with `args.device` read as the
    model's device (`MARKER`) on a CPU run so that what the trainer moves there is tagged."""
    import tempfile

    from datasets import Dataset
    from trl import DPOConfig

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    vocab = model.config.vocab_size
    prompts, completions = documents(4, seq_len // 16, vocab, 2), documents(8, seq_len // 16, vocab, 3)
    rows = [{"prompt_ids": prompts[i].tolist(), "chosen_ids": completions[2 * i].tolist(),
             "rejected_ids": completions[2 * i + 1].tolist()} for i in range(4)]
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                         logging_steps=1, report_to="none", save_strategy="no", use_cpu=not counter.cuda,
                         bf16=counter.cuda, max_length=seq_len, disable_dropout=True, loss_type=["sigmoid"])
        trainer = BlockdiagCPDPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                                        processing_class=word_tokenizer(), cp_size=cp_size, max_tokens=seq_len,
                                        cp_config=config, cp_mesh=group)
        count_second_training_step(trainer, counter)
        trainer.train()


def sft_trainer_steps(model, ref, group, cp_size, rank, device, counter, seq_len, config) -> None:
    """Two optimizer steps of `BlockdiagCPSFTTrainer` (4 documents in one pack, every token a target); the
    second step's `training_step` is counted, as `dpo_trainer_steps` counts it."""
    import tempfile

    from datasets import Dataset
    from trl import SFTConfig

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer

    docs = [{"input_ids": d.tolist()} for d in documents(4, seq_len // 4, model.config.vocab_size, seed=1)]
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_steps=2, per_device_train_batch_size=1, learning_rate=1e-3,
                         logging_steps=1, report_to="none", save_strategy="no", use_cpu=not counter.cuda,
                         bf16=counter.cuda, max_length=seq_len, packing=True, padding_free=False)
        trainer = BlockdiagCPSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(docs),
                                        processing_class=word_tokenizer(), cp_size=cp_size, cp_config=config,
                                        cp_mesh=group)
        count_second_training_step(trainer, counter)
        trainer.train()


def count_second_training_step(trainer, counter: SyncCounter) -> None:
    """Count the trainer's second `training_step`; on a CPU run with `args.device` read as `MARKER`, so that
    what the trainer moves to its device is tagged, and its models' weights tagged first."""
    step, calls = trainer.training_step, []

    def counted(*a, **kw):
        calls.append(1)
        if len(calls) != 2:
            return step(*a, **kw)
        saved = trainer.args.__dict__.get("_setup_devices")
        if not counter.cuda:
            trainer.args.__dict__["_setup_devices"] = MARKER
            for module in (trainer.model, getattr(trainer, "ref_model", None)):
                if module is not None:
                    counter.mark_module(module)
        counter.counting = True
        try:
            with counter:
                return step(*a, **kw)
        finally:
            counter.counting = False
            trainer.args.__dict__["_setup_devices"] = saved

    trainer.training_step = counted


def measure(family: str, task: str, group, cp_size: int, rank: int, args) -> dict:
    """Counts of the second of two steps of `task` ("sft", "dpo") with a tiny `family` model on this rank."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else MARKER
    counter = SyncCounter(cuda)
    config = CPConfig(attn_backend=args.attn_backend, kv_exchange=args.kv_exchange, layout=args.layout,
                      overlap={"off": False, "queries": True, "keys": "keys"}[args.overlap])
    dtype = torch.bfloat16 if cuda else torch.float32  # the GPU kernels run half precision only
    model = tiny_model(family).to("cuda" if cuda else "cpu", dtype)
    ref = tiny_model(family).to("cuda" if cuda else "cpu", dtype) if task.startswith("dpo") else None
    for module in (model, ref):
        if module is not None:
            counter.mark_module(module)
    if task.endswith("_trainer"):
        steps = dpo_trainer_steps if task == "dpo_trainer" else sft_trainer_steps
        return summary(family, task, cp_size, model, counter, args, debug_of(
            lambda: steps(model, ref, group, cp_size, rank, device, counter, args.seq_len, config), cuda))
    warnings_seen = 0
    for _ in range(2):  # the first step warms up; the second is counted
        counter.counts.clear()
        counter.copies.clear()

        def one_step():
            with counter:
                if task.startswith("sft"):
                    sft_step(model, group, cp_size, rank, device, counter, args.seq_len, config, task == "sft_full_pack")
                else:
                    dpo_step(model, ref, group, cp_size, rank, device, counter, args.seq_len, config)

        warnings_seen = debug_of(one_step, cuda)
        model.zero_grad(set_to_none=True)
    return summary(family, task, cp_size, model, counter, args, warnings_seen)


def debug_of(run, cuda: bool) -> int:
    """Run `run()`; on CUDA under `set_sync_debug_mode("warn")`, returning how many sync warnings it raised.
    (The counter's own modes only read tensors' devices and storages there: no syncs of their own.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def summary(family: str, task: str, cp_size: int, model, counter: SyncCounter, args, warnings_seen: int) -> dict:
    layers = model.config.num_hidden_layers
    rows = [{"op": op, "site": ours, "outer": outer, "count": n} for (op, ours, outer), n in counter.counts.items()]
    copies = [{"op": op, "site": ours, "outer": outer, "count": n} for (op, ours, outer), n in counter.copies.items()]
    return {"model": family, "task": task, "cp": cp_size, "layers": layers, "device": args.device,
            "syncs": sorted(rows, key=lambda r: (-r["count"], r["site"])), "total": sum(counter.counts.values()),
            "h2d_copies": sorted(copies, key=lambda r: (-r["count"], r["site"])),
            "h2d_total": sum(counter.copies.values()), "cuda_sync_warnings": warnings_seen}


def table(result: dict) -> str:
    head = (f"{result['model']} {result['task']} cp {result['cp']} ({result['layers']} layers, {result['device']}): "
            f"{result['total']} syncs per step, {result['h2d_total']} host->device copies"
            + (f", {result['cuda_sync_warnings']} CUDA sync warnings" if result["device"] == "cuda" else ""))
    lines = [head, f"  {'count':>5}  {'op':<36} {'our call site':<64} outer site"]
    for row in result["syncs"]:
        lines.append(f"  {row['count']:>5}  {row['op']:<36} {row['site']:<64} {row['outer']}")
    for row in result["h2d_copies"]:
        lines.append(f"  {row['count']:>5}  {row['op'] + ' (not a sync)':<36} {row['site']:<64} {row['outer']}")
    return "\n".join(lines)


def run_scenarios(group, cp_size: int, rank: int, args) -> list[dict]:
    """Every model and task at `cp_size` (the trainer at cp 1 only: at cp > 1 it needs a launcher's environment)."""
    return [measure(family, task, group, cp_size, rank, args) for family in args.models for task in args.tasks
            if not task.endswith("_trainer") or cp_size == 1]


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = run_scenarios(dist.group.WORLD, world, rank, args)
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def run_cp(cp_size: int, args) -> list[dict]:
    if cp_size == 1:
        return run_scenarios(None, 1, 0, args)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, cp_size, port, args, queue)) for r in range(cp_size)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["llama"], choices=["llama", "qwen3_5"])
    p.add_argument("--tasks", nargs="+", default=["dpo", "sft"], choices=["dpo", "sft", "sft_full_pack", "dpo_trainer", "sft_trainer"],
                   help="dpo, sft: the core step API on a pack sharded on the host; sft_full_pack: the full pack "
                        "on the device, sharded by the step; dpo_trainer, sft_trainer: the TRL trainers' training_step")
    p.add_argument("--cp", nargs="+", type=int, default=[1, 2], help="CP sizes (> 1 on the CPU: gloo ranks)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per pack (a multiple of 2 * cp)")
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--kv-exchange", default="allgather", help="CPConfig.kv_exchange (allgather, a2a, halo, heads, auto)")
    p.add_argument("--layout", default="contiguous", help="CPConfig.layout (contiguous, balanced, ...)")
    p.add_argument("--overlap", default="off", choices=["off", "queries", "keys"], help="CPConfig.overlap")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    if args.device == "cuda" and any(cp > 1 for cp in args.cp):
        p.error("--cp > 1 runs on the CPU only (gloo); on CUDA pass --cp 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for cp_size in args.cp:
        for result in run_cp(cp_size, args):
            print(table(result), flush=True)
            results.append(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))


if __name__ == "__main__":
    main()
