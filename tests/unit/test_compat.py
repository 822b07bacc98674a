"""What `hf_blockdiag_cp/compat/` relies on in each upstream, checked against the installed version:
each test fails with a message naming the upstream, the version found and the range the library was
checked with (`TESTED` of the module), so an upstream change shows here rather than as a wrong
result elsewhere. Run at both ends of the range (docs/testing.md, "The supported versions"). TRL's
part has its own file, test_trl_compat.py."""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
import transformers

from hf_blockdiag_cp.compat import torch as torch_compat
from hf_blockdiag_cp.compat import transformers as transformers_compat
from helpers.trainer import tiny_model


def _changed(module, what: str, version: str) -> str:
    return (f"{what} (found {version}; hf_blockdiag_cp/compat/{module.__name__.rsplit('.', 1)[1]}.py was checked with "
            f"{module.TESTED}): update that module")


# --------------------------------------------------------------------------- torch


def test_torch_forbid_in_graph_makes_dynamo_raise():
    def refuse():
        raise RuntimeError("ran eagerly")

    forbidden = torch_compat.forbid_in_graph(refuse)

    def traced(x):
        forbidden()
        return x + 1

    torch.compiler.reset()
    with pytest.raises(Exception) as caught:
        torch.compile(traced, backend="eager")(torch.ones(2))
    assert "ran eagerly" not in str(caught.value), _changed(
        torch_compat, "torch._dynamo.forbid_in_graph no longer stops tracing (the function ran as a graph break)",
        torch.__version__)


def test_torch_checkpoint_wrapper_keeps_the_wrapped_module():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(checkpoint_wrapper(inner))
    assert torch_compat.checkpoint_wrapped_module(model[0]) is inner, _changed(
        torch_compat, "checkpoint_wrapper no longer keeps its module in `_checkpoint_wrapped_module`", torch.__version__)
    assert torch_compat.checkpoint_wrapped_module(inner) is None
    names = {torch_compat.unwrapped_name(n) for n, m in model.named_modules() if m is inner}
    assert names == {"0"}, _changed(torch_compat, f"checkpoint_wrapper's module names changed: {names}", torch.__version__)


def test_torch_compile_wrapper_keeps_the_compiled_module():
    inner = torch.nn.Linear(2, 2)
    assert torch_compat.compiled_module(torch.compile(inner)) is inner, _changed(
        torch_compat, "torch.compile's OptimizedModule no longer keeps its module in `_orig_mod`", torch.__version__)
    assert torch_compat.compiled_module(inner) is None


def test_torch_dynamo_counts_the_graphs_it_compiles():
    before = torch_compat.compile_counters()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    after = torch_compat.compile_counters()
    assert after["graphs_compiled"] > before["graphs_compiled"] and after["frames_compiled"] > before["frames_compiled"], \
        _changed(torch_compat, f"torch._dynamo.utils.counters did not count a compile: {before} -> {after}", torch.__version__)


def test_torch_version_counter_counts_in_place_writes():
    t = torch.zeros(3, dtype=torch.long)
    before = torch_compat.tensor_version(t)
    t[0] = 1
    assert torch_compat.tensor_version(t) > before, _changed(
        torch_compat, "a tensor's `_version` did not count an in-place write", torch.__version__)
    assert torch_compat.tensor_version(t.clone()) == 0


def test_torch_cuda_sleep_exists():
    assert callable(getattr(torch.cuda, "_sleep", None)), _changed(torch_compat, "torch.cuda._sleep is gone",
                                                                   torch.__version__)


# --------------------------------------------------------------------------- transformers


def test_transformers_config_holds_the_attn_implementation():
    model = tiny_model("sdpa")
    assert transformers_compat.attn_implementation(model.config) == "sdpa", _changed(
        transformers_compat, "config._attn_implementation does not hold the implementation set", transformers.__version__)
    model.set_attn_implementation("eager")
    assert transformers_compat.attn_implementation(model.config) == "eager"
    assert transformers_compat.attn_implementation(object()) is None


def test_transformers_layers_checkpoint_through_their_checkpoint_function():
    model = tiny_model("sdpa").train()
    transformers_compat.enable_activation_checkpointing(model, use_reentrant=False)
    layer = model.model.layers[0]
    stock = transformers_compat.checkpoint_function(layer)
    assert isinstance(stock, functools.partial) and stock.func is torch.utils.checkpoint.checkpoint, _changed(
        transformers_compat, f"a checkpointed layer's `_gradient_checkpointing_func` is {stock!r}", transformers.__version__)
    assert stock.keywords.get("use_reentrant") is False
    calls = []

    def recording(function, *args, **kwargs):
        calls.append(function)
        return stock(function, *args, **kwargs)

    transformers_compat.set_checkpoint_function(layer, recording)
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    assert len(calls) == 1, _changed(transformers_compat, "a checkpointed layer no longer calls its "
                                     "`_gradient_checkpointing_func` once per forward", transformers.__version__)


def test_transformers_checkpointing_enabled_without_the_deprecated_name():
    """The current entry point where the installed release has it: no FutureWarning, every layer
    checkpointed with the kwargs given; the call in messages names the same method."""
    model = tiny_model("sdpa").train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        transformers_compat.enable_activation_checkpointing(model, use_reentrant=False)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert all(transformers_compat.checkpoint_function(layer).keywords["use_reentrant"] is False for layer in model.model.layers)
    current = hasattr(model, "activation_checkpointing_enable")
    assert transformers_compat.checkpointing_call().startswith(
        "model.activation_checkpointing_enable(" if current else "model.gradient_checkpointing_enable(")


def test_transformers_trainer_reads_the_loss_scaling_flag_from_5_19():
    reads = "loss_is_scaled_for_ga" in inspect.getsource(transformers.Trainer.training_step)
    assert reads == transformers_compat.trainer_reads_loss_scaling_flag(), _changed(
        transformers_compat, f"Trainer.training_step {'reads' if reads else 'does not read'} loss_is_scaled_for_ga",
        transformers.__version__)


# --------------------------------------------------------------------------- liger-kernel


def test_liger_applies_only_the_named_kernel_to_one_instance():
    """`apply_to_instance` with the loss only gives this model Liger's forward and leaves its class,
    its norms and another instance stock; `model_types` knows Llama (skipped where Liger cannot
    import: without liger-kernel or Triton)."""
    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")
    from importlib.metadata import version

    from hf_blockdiag_cp.compat import liger as liger_compat

    found = version("liger-kernel")
    try:
        types = liger_compat.model_types()
    except ImportError as exc:
        pytest.fail(_changed(liger_compat, f"monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN is gone: {exc!r}", found))
    assert "llama" in types, _changed(liger_compat, f"Liger's model types lack llama: {sorted(types)}", found)
    model, other = tiny_model("sdpa"), tiny_model("sdpa")
    stock = type(model).forward
    try:
        liger_compat.apply_to_instance(model, fused_linear_cross_entropy=True, cross_entropy=False, rope=False,
                                       rms_norm=False, swiglu=False, layer_norm=False)
    except (ImportError, TypeError) as exc:
        pytest.fail(_changed(liger_compat, f"_apply_liger_kernel_to_instance changed: {exc!r}", found))
    assert model.forward.__func__.__module__.startswith("liger_kernel."), _changed(
        liger_compat, f"the instance kept the forward {model.forward.__func__.__qualname__}", found)
    assert type(model).forward is stock and other.forward.__func__ is stock, _changed(
        liger_compat, "applying to one instance replaced the class's forward", found)
    norm = model.model.norm
    assert norm.forward.__func__ is type(norm).forward and type(norm) is type(other.model.norm), _changed(
        liger_compat, "rms_norm=False still replaced the model's norm", found)


def test_torch_device_mesh_flattens_and_unflattens_on_its_root():
    """`ParallelDims.build_mesh` keeps its dp x cp views on the root mesh through these two (exercised over
    real meshes by multiprocess/test_tp_cp_fsdp.py); here: they exist with the signatures it calls."""
    from torch.distributed.device_mesh import DeviceMesh

    for name, params in (("_flatten", ["mesh_dim_name"]), ("_unflatten", ["dim", "mesh_sizes", "mesh_dim_names"])):
        method = getattr(DeviceMesh, name, None)
        assert method is not None, _changed(torch_compat, f"DeviceMesh.{name} is gone", torch.__version__)
        assert list(inspect.signature(method).parameters)[1:1 + len(params)] == params, _changed(
            torch_compat, f"DeviceMesh.{name}{inspect.signature(method)}", torch.__version__)


def test_transformers_expands_a_tp_plan_over_the_model():
    model = tiny_model("sdpa")
    if not transformers_compat.tensor_parallel_supported():
        with pytest.raises(ImportError, match=f"transformers >= {transformers_compat.TP_MIN_TRANSFORMERS}"):
            transformers_compat.expanded_tp_plan(model, dict(model.tp_plan))
        pytest.skip(f"tensor parallelism needs transformers >= {transformers_compat.TP_MIN_TRANSFORMERS}")
    plan = transformers_compat.expanded_tp_plan(model, dict(model.tp_plan))
    assert plan.get("model.layers.0.self_attn.q_proj") == "colwise", _changed(
        transformers_compat, f"_expand_parallel_plan gave {sorted(plan)[:4]}...", transformers.__version__)
    with pytest.raises(TypeError, match="not a Transformers PreTrainedModel"):
        transformers_compat.expanded_tp_plan(torch.nn.Linear(2, 2), {})
