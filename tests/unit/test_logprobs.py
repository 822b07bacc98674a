"""The chunked log-prob head and per-document log-probs (`hf_blockdiag_cp.logprobs`) in one process.

- `token_log_probs` against a float64 dense computation (full `[N, V]` logits, the transform in
  float64, log_softmax): values, the gradients of hidden, weight and bias under a random upstream
  gradient, and every statistic, for each transform (scale, softcap, temperature, bias, all) and
  chunk sizes 1, one that does not divide N, one larger than N and the default.
- Memory: every tensor that any op builds, forward and backward, counted by a dispatch mode; with
  64-token chunks none exceeds 64 x vocab elements, while a full-logits computation of the same
  quantity does build tokens x vocab.
- `LogitTransform.of_config` on real tiny configs, and against what each model's forward does to
  its output embedding's result.
- `document_log_probs` at cp = 1 against the stock eager model run on each document alone (sums,
  counts, per-token log-probs and statistics, parameter gradients of a random weighting of the
  sums) for Llama, Gemma2 (final soft-capping) and Granite (logits_scaling); a model whose forward
  rescales its logits is refused; malformed local batches are refused by name; compiled models
  (per layer, per layer with activation checkpointing, whole) give the eager model's sums and
  gradients.
The same quantities under CP on real gloo groups: multiprocess/test_logprobs_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.torch import compile_counters
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.integrations.compile import compile_model
from hf_blockdiag_cp.logprobs import STATS, LogitTransform, document_log_probs, token_log_probs
from hf_blockdiag_cp.planning import document_ids_from_lengths
from helpers.compile_probe import RecordingBackend
from helpers.model_zoo import build_pair, tiny_mamba2_config
from helpers.reference import build_models, make_docs, rel_err

FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 head against float64: ~100 ulp of O(1) values
TOL = 1e-4  # whole model against the per-document reference (I1, fp32)
COMPILE_TOL = 1e-5  # compiled against eager, same kernels (as multiprocess/test_compile.py)


# --------------------------------------------------------------------------- the head against float64

N, H, V = 37, 16, 50
TRANSFORMS = {
    "plain": (LogitTransform(), False),
    "scale": (LogitTransform(scale=0.37), False),
    "softcap": (LogitTransform(softcap=2.0), False),
    "temperature": (LogitTransform(temperature=0.6), False),
    "bias": (LogitTransform(), True),
    "combined": (LogitTransform(scale=2.5, softcap=3.0, temperature=0.7), True),
}
CHUNKS = [1, 8, N + 13, None]  # 8 does not divide 37; None: default_chunk_size(V)


def head_inputs(with_bias: bool, seed: int = 0):
    """hidden [N, H], weight [V, H], bias [V] or None (fp32, requiring grad), targets [N] (half of them
    the float64 argmax of the raw logits, so that is_top1 is sometimes true), upstream gradient [N]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5  # raw logits of std ~2: the softcaps below bend them
    bias = torch.randn(V, generator=g) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    raw = hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())
    targets[::2] = raw.argmax(-1)[::2]
    upstream = torch.randn(N, generator=g)
    leaves = [t.requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    return (*leaves, targets, upstream)


def dense_float64(hidden, weight, bias, targets, transform: LogitTransform):
    """(log p(target) [N], {stat: [N]}) from the full float64 logits; differentiable in the float64 leaves."""
    raw = hidden @ weight.t()
    if bias is not None:
        raw = raw + bias
    z = raw * transform.scale
    if transform.softcap is not None:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    z = z / transform.temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    stats = {
        "entropy": -(p * logp).sum(-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == targets,  # torch.argmax: the first maximal index
        "log_sum_sq_probs": torch.log((p * p).sum(-1)),
    }
    return logp.gather(1, targets[:, None]).squeeze(1), stats


def as_float64_leaves(*tensors):
    return [None if t is None else t.detach().double().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_head_matches_float64_dense(name, chunk):
    transform, with_bias = TRANSFORMS[name]
    hidden, weight, bias, targets, upstream = head_inputs(with_bias)
    log_probs, stats = token_log_probs(hidden, weight, bias, targets, transform, chunk_size=chunk, stats=STATS)
    (log_probs * upstream).sum().backward()

    leaves = as_float64_leaves(hidden, weight, bias)
    want, want_stats = dense_float64(*leaves, targets, transform)
    (want * upstream.double()).sum().backward()

    assert log_probs.dtype == torch.float32 and log_probs.shape == (N,)
    torch.testing.assert_close(log_probs, want.float(), **FP32_TOL)
    for got, ref in zip((hidden, weight, bias), leaves):
        if got is not None:
            torch.testing.assert_close(got.grad, ref.grad.float(), **FP32_TOL)
    assert set(stats) == set(STATS)
    assert stats["is_top1"].dtype == torch.bool and torch.equal(stats["is_top1"], want_stats["is_top1"])
    assert 0 < int(stats["is_top1"].sum()) < N  # the check above saw both answers
    for stat in ("entropy", "mean_logits", "log_sum_sq_probs"):
        assert not stats[stat].requires_grad
        torch.testing.assert_close(stats[stat], want_stats[stat].float(), **FP32_TOL, msg=stat)


@pytest.mark.parametrize("name", [n for n in TRANSFORMS if n != "plain"])
def test_each_transform_changes_the_reference(name):
    """Guard on the data above: each transform moves the log-probs far beyond the tolerance, so a head
    that ignored it would fail."""
    transform, with_bias = TRANSFORMS[name]
    hidden, weight, bias, targets, _ = head_inputs(with_bias)
    leaves = as_float64_leaves(hidden, weight, bias)
    with torch.no_grad():
        with_it, _ = dense_float64(*leaves, targets, transform)
        without, _ = dense_float64(leaves[0], leaves[1], None, targets, LogitTransform())
    assert (with_it - without).abs().max() > 0.1


def test_is_top1_takes_the_first_of_tied_maxima():
    """Two vocabulary rows with equal logits (zero weight rows, equal and largest bias): the target is
    top-1 if it is the first of them, not if it is the second."""
    hidden = torch.randn(4, H)
    weight = torch.randn(V, H) * 0.1
    bias = torch.zeros(V)
    weight[[3, 7]] = 0.0
    bias[[3, 7]] = 10.0
    targets = torch.tensor([3, 7, 3, 0])
    for transform in (LogitTransform(), TRANSFORMS["combined"][0]):
        _, stats = token_log_probs(hidden, weight, bias, targets, transform, chunk_size=3, stats=("is_top1",))
        assert stats["is_top1"].tolist() == [True, False, True, False]


def test_head_without_gradients_for_some_inputs():
    """A frozen output embedding (no weight / bias gradient): the hidden states' gradient is unchanged."""
    transform, _ = TRANSFORMS["combined"]
    hidden, weight, bias, targets, upstream = head_inputs(True)
    log_probs, _ = token_log_probs(hidden, weight.detach(), bias.detach(), targets, transform, chunk_size=8)
    (log_probs * upstream).sum().backward()
    leaves = as_float64_leaves(hidden, weight, bias)
    want, _ = dense_float64(*leaves, targets, transform)
    (want * upstream.double()).sum().backward()
    torch.testing.assert_close(hidden.grad, leaves[0].grad.float(), **FP32_TOL)


# --------------------------------------------------------------------------- memory


class LargestTensors(TorchDispatchMode):
    """Records, for every op dispatched while active, the largest numel among its tensor outputs."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        numels = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if numels:
            self.sizes.append((max(numels), str(func)))
        return out


def largest_tensors(loss_fn, *leaves) -> tuple[tuple[int, str], tuple[int, str], int]:
    """(largest output of the forward, of the backward, ops seen in the backward) of `loss_fn(*leaves).backward()`."""
    with LargestTensors() as forward:
        loss = loss_fn(*leaves)
    with LargestTensors() as backward:
        loss.backward()
    assert all(leaf.grad is not None for leaf in leaves)
    return max(forward.sizes), max(backward.sizes), len(backward.sizes)


def test_largest_tensor_is_one_chunk_of_logits():
    """For a 64-token chunk, the largest tensor the loss builds (forward and backward) has chunk x vocab
    elements, not tokens x vocab; the same count on a full-logits loss finds tokens x vocab."""
    tokens, vocab, width, chunk = 1024, 1000, 32, 64
    assert tokens * vocab > 10 * chunk * vocab and chunk * vocab > max(vocab * width, tokens * width)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, requires_grad=True)
    bias = torch.randn(vocab, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    upstream = torch.randn(tokens, generator=g)
    transform = LogitTransform(scale=0.5, softcap=3.0, temperature=0.9)

    def chunked(h, w, b):
        log_probs, _ = token_log_probs(h, w, b, targets, transform, chunk_size=chunk, stats=STATS)
        return (log_probs * upstream).sum()

    def full_logits(h, w, b):
        z = transform.apply(h @ w.t() + b)
        return (torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1) * upstream).sum()

    fwd, bwd, backward_ops = largest_tensors(chunked, hidden, weight, bias)
    assert backward_ops > 10, "the backward's ops were not seen"
    for phase, (numel, op) in (("forward", fwd), ("backward", bwd)):
        assert numel <= chunk * vocab, f"{phase}: {op} built {numel} elements > chunk x vocab = {chunk * vocab}"
        assert numel < tokens * vocab
    for leaf in (hidden, weight, bias):
        leaf.grad = None
    fwd, bwd, _ = largest_tensors(full_logits, hidden, weight, bias)
    assert fwd[0] >= tokens * vocab > chunk * vocab and bwd[0] >= tokens * vocab, (fwd, bwd)


# --------------------------------------------------------------------------- LogitTransform.of_config


def _cohere_config(**kw):
    from transformers import CohereConfig

    return CohereConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, **kw)


def _gemma3_config(**kw):
    """A composite config: the softcap lives in its text config."""
    from transformers import Gemma3Config

    return Gemma3Config(text_config=dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw),
                        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4))


CONFIG_TRANSFORMS = [
    ("llama", lambda: build_models("llama")[0].config, LogitTransform()),
    ("gemma2", lambda: build_pair("gemma2")[0].config, LogitTransform(softcap=5.0)),
    ("granite", lambda: build_pair("granite")[0].config, LogitTransform(scale=1 / 3.0)),
    ("cohere", lambda: _cohere_config(logit_scale=0.25), LogitTransform(scale=0.25)),
    ("falcon_h1", lambda: tiny_mamba2_config("falcon_h1", lm_head_multiplier=0.7), LogitTransform(scale=0.7)),
    ("gemma3", lambda: _gemma3_config(final_logit_softcapping=7.0), LogitTransform(softcap=7.0)),
]


CONFIG_TRANSFORMS_BY_FAMILY = [(family, make) for family, make, _ in CONFIG_TRANSFORMS]


@pytest.mark.parametrize("family,make_config,expected", CONFIG_TRANSFORMS, ids=[c[0] for c in CONFIG_TRANSFORMS])
def test_transform_of_config(family, make_config, expected):
    config = make_config()
    got = LogitTransform.of_config(config)
    assert got.softcap == expected.softcap and got.temperature == 1.0
    assert got.scale == pytest.approx(expected.scale, rel=1e-12)
    assert LogitTransform.of_config(config, temperature=0.5).temperature == 0.5


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere", "falcon_h1"])
def test_transform_of_config_is_what_the_forward_does(family):
    """The model's returned logits equal `of_config(config).apply` of its output embedding's result
    (captured by a hook: the model's own forward, not the library's), and differ from that result."""
    from transformers import AutoModelForCausalLM

    if family in ("gemma2", "granite"):
        model = build_pair(family)[0]
    else:
        torch.manual_seed(0)
        config = dict(CONFIG_TRANSFORMS_BY_FAMILY)[family]()
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    raw = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: raw.append(out.detach()))
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    hook.remove()
    want = LogitTransform.of_config(model.config).apply(raw[0])
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    assert (logits - raw[0]).abs().max() > 1e-2


def test_transform_refuses_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        LogitTransform(temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        LogitTransform(softcap=-1.0)


# --------------------------------------------------------------------------- document_log_probs at cp = 1

LENGTHS = [6, 1, 9, 4, 7]  # with a 1-token document (no target)
PROMPTS = {0: 3, 2: 4}  # document index -> leading tokens whose labels are -100 (a prompt)
N_PAD = 2


def masked_pack(lengths=LENGTHS, prompts=PROMPTS, n_pad=N_PAD, seed=1):
    """(documents, their labels, packed batch): labels -100 on each document's prompt and on the padding."""
    docs = make_docs(lengths, seed)
    labels = [d.clone() for d in docs]
    for i, n in prompts.items():
        labels[i][:n] = -100
    ids = torch.cat(docs + [torch.zeros(n_pad, dtype=torch.long)])[None]
    batch = {
        "input_ids": ids,
        "labels": torch.cat(labels + [torch.full((n_pad,), -100)])[None],
        "document_ids": document_ids_from_lengths(lengths, ids.shape[1])[None],
    }
    return docs, labels, batch


def per_document_reference(ref, docs, labels):
    """The stock model on each document alone: per document, the float64 sum of log p(next token) over
    the positions whose next label is not -100, their count, the per-token log-probs of the pack
    (position p scores token p + 1 of its document; 0 where there is no target) and each statistic's
    per-token values and per-document sums."""
    sums, counts, tokens, stat_tokens = [], [], [], {name: [] for name in STATS}
    for d, lab in zip(docs, labels):
        logits = ref(input_ids=d[None]).logits[0].double()
        logp_all = torch.log_softmax(logits[:-1], -1)
        logp = logp_all.gather(1, d[1:, None]).squeeze(1)
        keep = (lab[1:] != -100).double()
        p = logp_all.exp()
        values = {
            "entropy": -(p * logp_all).sum(-1),
            "mean_logits": logits[:-1].mean(-1),
            "is_top1": (logits[:-1].argmax(-1) == d[1:]).double(),
            "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        }
        zero = logits.new_zeros(1)
        sums.append((logp * keep).sum())
        counts.append(int(keep.sum()))
        tokens.append(torch.cat([logp * keep, zero]))
        for name in STATS:
            stat_tokens[name].append(torch.cat([values[name].detach() * keep, zero]))
    return {
        "sums": torch.stack(sums), "counts": torch.tensor(counts), "tokens": torch.cat(tokens),
        "stats": {name: torch.cat(v) for name, v in stat_tokens.items()},
    }


def global_rows(values: torch.Tensor, layout) -> torch.Tensor:
    """A per-position vector of the pack's real tokens, laid out as rank 0's shard (0 on padding)."""
    padded = values.new_zeros(layout.padded_seq_len)
    padded[: values.numel()] = values
    return padded[layout.slot_positions[0]]


def build(family):
    return build_models("llama") if family == "llama" else build_pair(family)


def cp1_log_probs(model, batch, stats=()):
    train_ctx, local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    with train_ctx():
        result = document_log_probs(model, local, stats=stats)
        weights = torch.randn(result.num_documents, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        (weights * result.sums).sum().backward()
    return result, layout, weights


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_document_log_probs_cp1_match_each_document_alone(family):
    """cp = 1 (a step without a group) on a pack with masked prompts, a 1-token document and padding:
    every output against the stock eager model on each document alone (its own scale / soft-capping)."""
    ref, model = build(family)
    docs, labels, batch = masked_pack()
    result, layout, weights = cp1_log_probs(model, batch, stats=STATS)
    want = per_document_reference(ref, docs, labels)
    ref.zero_grad(set_to_none=True)
    (weights * want["sums"]).sum().backward()
    want_grads = grads_of(ref)

    assert result.sums.dtype == torch.float64 and result.sums.shape == (len(docs),)
    assert result.counts.tolist() == want["counts"].tolist() == [3, 0, 5, 3, 6]
    assert rel_err(result.sums.detach(), want["sums"].detach()) <= TOL
    assert result.sums[1].item() == 0.0  # the 1-token document has no target
    assert rel_err(result.token_log_probs[0].detach(), global_rows(want["tokens"].detach(), layout)) <= TOL
    for name in ("entropy", "mean_logits", "log_sum_sq_probs"):
        assert rel_err(result.stats[name][0], global_rows(want["stats"][name], layout)) <= TOL, name
        assert rel_err(result.stat_sums[name], result.per_document(result.stats[name])) <= 1e-12, name
    assert torch.equal(result.stats["is_top1"][0], global_rows(want["stats"]["is_top1"], layout).float())
    grads = grads_of(model)
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        assert rel_err(grads[name], g) <= TOL, f"{family}: {name}"


def test_masked_prompt_changes_the_reference():
    """Guard on the pack: the masked prompt tokens carry log-prob mass, so ignoring the mask would fail."""
    ref, _ = build_models("llama")
    docs, labels, _ = masked_pack()
    with torch.no_grad():
        masked = per_document_reference(ref, docs, labels)["sums"]
        unmasked = per_document_reference(ref, docs, docs)["sums"]
    assert (masked - unmasked).abs()[list(PROMPTS)].min() > 1.0


# --------------------------------------------------------------------------- the probe and bad input


@pytest.mark.parametrize("factor", [3.0, 1.05])
def test_model_that_rescales_its_logits_is_refused(factor):
    """A Llama whose forward rescales its logits (a transform `LogitTransform` does not know; 5% is enough)
    is refused with what the head applied and by how much the model's logits differ; at every call."""
    _, model = build_models("llama")
    model.register_forward_hook(lambda module, args, out: out.__setitem__("logits", out["logits"] * factor) or out)
    _, _, batch = masked_pack()
    for _ in range(2):
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
        with train_ctx(), pytest.raises(NotImplementedError) as caught:
            document_log_probs(model, local)
        message = str(caught.value)
        assert "transforms its logits" in message and "differ by" in message
        assert "LogitTransform(scale=1.0, softcap=None" in message


def test_model_whose_logit_scale_differs_from_its_config_is_refused():
    """Cohere reads `logit_scale` at construction: a config changed afterwards no longer describes the
    forward, and the probe must notice (the head would apply 0.5, the model applies 0.25)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_cohere_config(logit_scale=0.25),
                                             attn_implementation=bdcp.ATTN_IMPLEMENTATION)
    model.config.logit_scale = 0.5
    _, _, batch = masked_pack()
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    with train_ctx(), pytest.raises(NotImplementedError, match=r"scale=0\.5.*differ by"):
        document_log_probs(model, local)


def test_local_batch_without_labels_is_refused():
    _, model = build_models("llama")
    _, _, batch = masked_pack()
    del batch["labels"]
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    with pytest.raises(ValueError, match=r"local\['shift_labels'\] is missing"), train_ctx():
        document_log_probs(model, local)


def test_step_holds_the_shard_targets_of_its_labels():
    """The step's host copy of the shard's targets (what the head scores without reading the labels back
    from the device) is where the local labels have targets, and their range."""
    _, model = build_models("llama")
    _, _, batch = masked_pack()
    _, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    labels, known = local["shift_labels"], local["blockdiag_cp_step"].targets
    rows = (labels[0] != -100).nonzero().squeeze(1)
    assert rows.numel() > 0 and torch.equal(known.rows, rows) and known.describe(labels)
    assert (known.low, known.high) == (int(labels[0, rows].min()), int(labels[0, rows].max()))
    labels[0, 0] = 7
    assert not known.describe(labels) and not known.describe(labels.clone())


@pytest.mark.parametrize("where", ["batch", "replaced", "in place"])
@pytest.mark.parametrize("bad", [101, 5000, -3])  # vocab is 101; -3 is negative but not -100
def test_target_outside_the_vocabulary_is_refused(bad, where):
    """In the pack (the step's host copy of the targets holds it), or in the local labels replaced or edited in
    place after the step (the host copy no longer describes them: they are read anew)."""
    _, model = build_models("llama")
    _, _, batch = masked_pack()
    if where == "batch":  # cp = 1: shard position p's target is the pack's label p + 1
        _, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
        batch["labels"][0, int((local["shift_labels"][0] != -100).nonzero()[0]) + 1] = bad
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    if where == "replaced":
        labels = local["shift_labels"].clone()
        labels[0, 4] = bad
        local["shift_labels"] = labels
    elif where == "in place":
        local["shift_labels"][0, 4] = bad
    message = r"local\['shift_labels'\].*outside the vocabulary \[0, 101\)"
    with pytest.raises(ValueError, match=message), train_ctx():
        document_log_probs(model, local)


# --------------------------------------------------------------------------- torch.compile

COMPILE_VARIANTS = [("layers", False), ("layers", True), ("model", False)]


def test_compiled_model_gives_the_eager_sums_and_gradients():
    """`compile_model` (aot_eager, as multiprocess/test_compile.py) per layer, per layer with activation
    checkpointing, and whole, each around a copy of the same weights: on three packs of one length,
    sums, counts and every parameter gradient equal the eager model's, every call runs compiled graphs
    that hold the decoder layers' math, and the third pack compiles nothing. The variants run in turn
    on one recording backend, as a user's second model would: a later one runs the graphs an earlier
    one compiled where dynamo's guards allow. (The first call runs the output embedding on the probe's
    2 rows, later ones on none: with regions="model" the second call compiles that shape once more.)"""
    torch.compiler.reset()
    recording = RecordingBackend("aot_eager")
    before = compile_counters()
    _, eager = build_models("llama")
    for i, (regions, checkpointing) in enumerate(COMPILE_VARIANTS):
        compiled = copy.deepcopy(eager)
        if checkpointing:
            enable_activation_checkpointing(compiled, use_reentrant=False)
        compile_model(compiled, regions, backend=recording)
        compiled_so_far = []
        for seed in (1, 2, 3):
            what = f"{regions}, checkpointing {checkpointing}, pack {seed}"
            _, _, batch = masked_pack(seed=seed)
            eager.zero_grad(set_to_none=True)
            compiled.zero_grad(set_to_none=True)
            want, _, _ = cp1_log_probs(eager, batch)
            calls = recording.calls()
            got, _, _ = cp1_log_probs(compiled, batch)
            ran = recording.ran_between(calls, recording.calls())
            ops = " ".join(op for graph in ran for op in graph["ops"])
            assert "silu" in ops and "rsqrt" in ops, f"{what}: no decoder layer ran compiled: {ops}"
            assert torch.equal(got.counts, want.counts)
            assert rel_err(got.sums.detach(), want.sums.detach()) <= COMPILE_TOL
            want_grads, grads = grads_of(eager), grads_of(compiled)
            assert set(grads) == set(want_grads)
            for name, g in want_grads.items():
                assert rel_err(grads[name], g) <= COMPILE_TOL, f"{what}: {name}"
            counted = compile_counters()
            compiled_so_far.append((counted["frames_compiled"], counted["graphs_compiled"]))
        assert i or compiled_so_far[0][1] > before["graphs_compiled"], "nothing compiled"
        assert compiled_so_far[2] == compiled_so_far[1], f"{regions}: the third pack compiled again: {compiled_so_far}"
