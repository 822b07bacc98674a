"""The per-document parity reference of the tests.

Exactness (invariant I1, docs/design.md) is checked against the **stock model, unpacked**: the
Transformers model with `attn_implementation="eager"` run on every document separately. Nothing
here uses the CP code: `build_models` only switches a deep copy of the reference to
`blockdiag_cp` for the caller to run under CP. Also: tiny configs of the parity families, random
documents, named pack layouts for any CP size, and the error measures (relative error, mean
over a process group, the fp32 bound against a float64 run of the stock model).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, MistralConfig, Qwen2Config

from hf_blockdiag_cp import ATTN_IMPLEMENTATION

VOCAB = 101

COMMON_CONFIG = dict(  # the tiny decoder shared by every parity test
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


# --------------------------------------------------------------------------- models


def tiny_config(family: str, **overrides):
    if family == "llama":
        cfg = LlamaConfig(**COMMON_CONFIG)
    elif family == "qwen2":
        cfg = Qwen2Config(**COMMON_CONFIG, use_sliding_window=False)
    elif family == "mistral":
        cfg = MistralConfig(**COMMON_CONFIG, sliding_window=overrides.pop("sliding_window", 4096))
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_models(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """(reference eager model, blockdiag_cp model) with identical weights."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager", dtype=dtype)
    ref.train()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ref, model


# --------------------------------------------------------------------------- documents and packs


def make_docs(lengths, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


LAYOUTS = ("straddle", "span_all", "padding_rank", "single_tokens", "single_doc", "collator")


def layout_lengths(name: str, world_size: int) -> tuple[list[int], int]:
    """Document lengths and the number of padding tokens (document id 0) at the end of the pack."""
    g = world_size
    if name in ("straddle", "collator"):
        return [5, 7, 3, 9, 4], 0
    if name == "span_all":  # one document over every rank (three or more when G >= 3)
        return [2, 8 * g + 1, 3], 0
    if name == "padding_rank":  # 3G real tokens then 3G padding: the last rank holds only padding
        return [g, 2 * g], 3 * g
    if name == "single_tokens":
        return [1, 3, 1, 1, 5, 1, 2, 1, 4, 1], 0
    if name == "single_doc":
        return [4 * g + 3], 0
    raise ValueError(name)


def make_pack(name: str, world_size: int, seed: int = 1, pad_token_id: int = 0):
    """(documents, packed batch in Hugging Face's flattened convention)."""
    lengths, n_pad = layout_lengths(name, world_size)
    docs = make_docs(lengths, seed)
    if name == "collator":
        batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
        return docs, dict(batch)
    ids = torch.cat(docs + [torch.full((n_pad,), pad_token_id)])[None]
    labels = ids.clone()
    labels[0, ids.shape[1] - n_pad:] = -100
    batch = {"input_ids": ids, "labels": labels}
    if n_pad:
        doc_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(n_pad, dtype=torch.long)])
        batch["document_ids"] = doc_ids[None]
    else:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, batch


# --------------------------------------------------------------------------- the reference and errors


def _document_batches(docs, extra_per_doc, group=None):
    """The stock model's inputs, one document per row: documents of equal length share one forward
    (a batch without padding or mask; each row attends to itself only), those with extra inputs run
    alone; a 1-token document has no target and adds nothing to the loss, so it does not run. With a
    `group`, this rank's share of them: longest first, each to the rank with the fewest tokens so far."""
    if extra_per_doc:
        batches = [(d[None], extra) for d, extra in zip(docs, extra_per_doc) if d.numel() > 1]
    else:
        by_length = {}
        for d in docs:
            if d.numel() > 1:
                by_length.setdefault(d.numel(), []).append(d)
        batches = [(torch.stack(same), {}) for same in by_length.values()]
    if group is None or dist.get_world_size(group) == 1:
        return batches
    load, rank = [0] * dist.get_world_size(group), dist.get_rank(group)
    mine = []
    for ids, extra in sorted(batches, key=lambda b: -b[0].numel()):
        least = min(range(len(load)), key=load.__getitem__)
        load[least] += ids.numel()
        if least == rank:
            mine.append((ids, extra))
    return mine


def _local_loss_and_grads(ref, docs, extra_per_doc, group):
    """This rank's part (`_document_batches`) of the reference loss, scaled by the whole count of
    targets, and its gradients (zeros where none reached a parameter, which `has` tells)."""
    ref.zero_grad(set_to_none=True)
    count = sum(d.numel() - 1 for d in docs if d.numel() > 1)
    total = torch.zeros((), dtype=torch.float32, device=next(ref.parameters()).device)  # float64 under `Float64`
    for ids, extra in _document_batches(docs, extra_per_doc, group):
        logits = ref(input_ids=ids, **extra).logits
        total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    loss = total / count
    if loss.requires_grad:
        loss.backward()
    params = dict(ref.named_parameters())
    has = {n: p.grad is not None for n, p in params.items()}
    grads = {n: p.grad.detach().clone() if has[n] else torch.zeros_like(p) for n, p in params.items()}
    return loss.detach(), grads, has


def _sum_over_group(loss, grads, has, group):
    """The reference of `_local_loss_and_grads` summed over the ranks that shared it (one all-reduce):
    (loss, {name: gradient} of the parameters a gradient reached on some rank)."""
    if group is not None and dist.get_world_size(group) > 1:
        flags = torch.tensor([float(h) for h in has.values()], dtype=loss.dtype, device=loss.device)
        flat = torch.cat([loss.reshape(1), flags, *(g.reshape(-1).to(loss.dtype) for g in grads.values())])
        dist.all_reduce(flat, group=group)
        loss, flags, parts = flat[0], flat[1 : 1 + len(has)], flat[1 + len(has) :].split([g.numel() for g in grads.values()])
        grads = {n: v.view_as(g).to(g.dtype) for (n, g), v in zip(grads.items(), parts)}
        has = dict(zip(has, (bool(f > 0) for f in flags)))
    return loss, {n: g for n, g in grads.items() if has[n]}


def reference_loss_and_grads(ref, docs, extra_per_doc=None, group=None):
    """Mean next-token loss over all documents run separately, and its parameter gradients.

    `extra_per_doc[i]` holds extra model inputs of document i (e.g. 3-D positions, pixels). With a
    process `group` (every rank passing the same model and documents), the documents are spread over
    its ranks and every rank gets the whole reference."""
    return _sum_over_group(*_local_loss_and_grads(ref, docs, extra_per_doc, group), group)


class Float64(TorchFunctionMode):
    """Run stock code in float64 where it asks for float32: `.float()`, `.to(torch.float32)`,
    `dtype=torch.float32` and the default dtype all give float64 inside the mode. Stock models cast to
    float32 for their norms, softmax, rotary and delta rule; without this a "float64" run would round
    there in fp32."""

    def __enter__(self):
        self.lower = set()  # the functions that still returned a lower-precision float (none in a float64 run)
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype in (torch.float32, torch.float16, torch.bfloat16):
            self.lower.add(func.__name__)
        return out


def float64_reference(ref, docs, extra_per_doc=None, group=None):
    """`reference_loss_and_grads` of a float64 copy of `ref`, every float32 cast inside it in float64
    too (`Float64`): the reference that fp32 runs, ours and the stock model's, are measured against."""
    ref64 = copy.deepcopy(ref).double()
    if getattr(ref64.config, "_experts_implementation", "eager") != "eager":  # grouped_mm has no float64
        ref64.set_experts_implementation("eager")
    with Float64() as mode:
        local = _local_loss_and_grads(ref64, docs, extra_per_doc, group)
    if mode.lower:
        raise AssertionError(f"the float64 reference computed in lower precision in {sorted(mode.lower)}")
    return _sum_over_group(*local, group)


def mean_over_group(t: torch.Tensor, group, world_size: int) -> torch.Tensor:
    t = t.detach().clone().float()
    if world_size > 1:
        dist.all_reduce(t, group=group)
    return t / world_size


def means_over_group(tensors: dict, group, world_size: int) -> dict:
    """`mean_over_group` of every tensor of a dict, in one all-reduce (the same sums, element by element)."""
    flat = mean_over_group(torch.cat([t.detach().float().reshape(-1) for t in tensors.values()]), group, world_size)
    return {name: v.view(t.shape) for (name, t), v in zip(tensors.items(), flat.split([t.numel() for t in tensors.values()]))}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (||a - b|| where b is zero), computed in float64 so that it resolves fp32 rounding
    against a float64 reference."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm()
    diff = (a - b).norm()
    return float(diff / denom) if denom > 0 else float(diff)


def compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size):
    """Max relative error of the mean-over-ranks loss and of every parameter gradient."""
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    means = means_over_group({"loss": loss.reshape(1), **grads}, group, world_size)
    errors = {"loss": rel_err(means.pop("loss").reshape(()), ref_loss)}
    for name, p in model.named_parameters():
        errors[name] = rel_err(means[name], ref_grads.get(name, torch.zeros_like(p)))
    return errors


# The fp32 parity bound (docs/testing.md, "The reference"): per parameter, the CP gradient's error against
# the float64 reference may be ROUNDING_FACTOR times the stock fp32 model's own error plus ROUNDING_FLOOR.
ROUNDING_FACTOR = 4.0
ROUNDING_FLOOR = 5e-5


def fp32_references(ref, docs, extra_per_doc=None, group=None):
    """The stock fp32 model per document and its float64 copy: ((loss, grads), (loss, grads)); with a
    `group`, built by its ranks together (`reference_loss_and_grads`)."""
    return reference_loss_and_grads(ref, docs, extra_per_doc, group), float64_reference(ref, docs, extra_per_doc, group)


def within_rounding(model, loss, references, group, world_size) -> dict | None:
    """The mean-over-ranks loss and gradients of `model` against the float64 reference of
    `fp32_references`: `{"loss": relative error, "worst": (name, ours, stock, bound)}`, where `worst` is
    the parameter closest to (or furthest over) its bound ROUNDING_FACTOR * stock + ROUNDING_FLOOR,
    `ours` and `stock` being the relative errors of the CP gradient and of the stock fp32 gradient.
    Every rank calls it (the means are collectives); `references` None: the rank does not check
    (the means are the same on every rank, so a caller may check on one rank), -> None."""
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    means = means_over_group({"loss": loss.reshape(1), **grads}, group, world_size)
    mean_loss = means.pop("loss").reshape(())
    if references is None:
        return None
    (_, stock_grads), (loss64, grads64) = references
    worst = None
    for name, ours_grad in means.items():
        zero = torch.zeros_like(ours_grad)
        exact = grads64.get(name, zero)
        ours, stock = rel_err(ours_grad, exact), rel_err(stock_grads.get(name, zero), exact)
        bound = ROUNDING_FACTOR * stock + ROUNDING_FLOOR
        if worst is None or ours / bound > worst[1] / worst[3]:
            worst = (name, ours, stock, bound)
    return {"loss": rel_err(mean_loss, loss64), "worst": worst}


def check_layer_per_document(stock, patched, lengths, tol: float = 1e-5, seed: int = 3) -> None:
    """A patched token-mixer layer given one packed row of random hidden states and `cu_seq_lens_q`
    against the stock layer run on each document alone: its output and every parameter gradient (of
    the output against a random probe) within `tol`; and the stock layer on the packed row more than
    1e-3 off, so that the per-document reference discriminates."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    width = getattr(stock, "hidden_size", None) or stock.config.hidden_size  # LFM2's ShortConv: only its config
    x, probe = (torch.randn(1, total, width, generator=g) for _ in range(2))
    stock.zero_grad(set_to_none=True)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ref_out = torch.cat([stock(x[:, a:b]) for a, b in zip(starts[:-1], starts[1:])], dim=1)
    (ref_out * probe).sum().backward()
    out = patched(x, cu_seq_lens_q=torch.tensor(starts, dtype=torch.int32))
    (out * probe).sum().backward()
    assert rel_err(out.detach(), ref_out.detach()) <= tol
    for (name, p), (_, q) in zip(patched.named_parameters(), stock.named_parameters()):
        assert rel_err(p.grad, q.grad) <= tol, name
    with torch.no_grad():
        assert rel_err(stock(x), ref_out) > 1e-3  # stock on the pack: documents leak into each other


def simple_gla_reference(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, **_):
    """fla's `chunk_simple_gla` and `chunk_gla` as their docstrings define them, in float64 and run by
    run, to check what our records feed them on the CPU: S_t = diag(exp(g_t))·S_{t-1} + k_t ⊗ v_t
    ([K, V] per head, [V, K] with `state_v_first`; g per row `[1, T, H]`, per row and key channel
    `[1, T, H, K]` (GLA), or `g_gamma [H]` for every row), o_t = scale·q_t·S_t, from `initial_state`
    (zero: None) at each run of `cu_seqlens`."""
    q, k, v = (t[0].double() for t in (q, k, v))
    log_decay = g[0].double() if g is not None else g_gamma.double().expand(q.shape[0], -1)
    if log_decay.dim() == 2:  # one decay per head: the same on every key channel
        log_decay = log_decay[..., None].expand(-1, -1, q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, finals = torch.zeros_like(v), []
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
        if initial_state is not None:
            start = initial_state[i].double()
            state = start.transpose(-1, -2) if state_v_first else start
        for t in range(a, b):
            state = torch.exp(log_decay[t])[:, :, None] * state + k[t][:, :, None] * v[t][:, None, :]
            out[t] = scale * torch.einsum("hk,hkv->hv", q[t], state)
        finals.append(state.transpose(-1, -2) if state_v_first else state)
    return out[None].to(v.dtype), torch.stack(finals) if output_final_state else None


def fake_fla_gla(monkeypatch) -> None:
    """Make `from fla.ops.simple_gla import chunk_simple_gla` and `from fla.ops.gla import chunk_gla` give
    `simple_gla_reference` (fla absent on CPU)."""
    import sys
    import types

    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", types.SimpleNamespace(chunk_simple_gla=simple_gla_reference))
    monkeypatch.setitem(sys.modules, "fla.ops.gla", types.SimpleNamespace(chunk_gla=_gla_reference))


def _gla_reference(q, k, v, g, **kwargs):
    """`chunk_gla`: a gate per key channel, with fla's own check of the shapes."""
    assert q.shape == k.shape == g.shape, "q, k, g must have the same shape."
    return simple_gla_reference(q, k, v, g=g, **kwargs)
