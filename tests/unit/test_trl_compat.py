"""What the TRL trainers rely on in TRL beyond its public API (`hf_blockdiag_cp/compat/trl.py`), checked
against the installed TRL: every private method they override or call exists with the parameters
listed there, every override is listed and takes what TRL passes, every TRL attribute they read is
listed and set by TRL, `_get_per_token_logps_and_entropies` returns what `LOGPS_RESULT` says, and
`prepare_like_trl` prepares data as `SFTTrainer` does. Each failure names the TRL found and the
releases the module was verified with. Under a TRL outside `VERIFIED` constructing any of the five
trainers logs one line naming the verified releases (the version TRL reports is faked)."""

from __future__ import annotations

import inspect
import logging
import re
import typing

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import transformers  # noqa: E402
import trl  # noqa: E402

from hf_blockdiag_cp.compat import trl as trl_compat  # noqa: E402
from hf_blockdiag_cp.integrations import trl as ours  # noqa: E402

OURS = {"SFTTrainer": ours.BlockdiagCPSFTTrainer, "DPOTrainer": ours.BlockdiagCPDPOTrainer,
        "RewardTrainer": ours.BlockdiagCPRewardTrainer, "GRPOTrainer": ours.BlockdiagCPGRPOTrainer,
        "RLOOTrainer": ours.BlockdiagCPRLOOTrainer}


def _changed(what: str) -> str:
    return (f"{what} (found TRL {trl.__version__}; hf_blockdiag_cp/compat/trl.py was verified with {trl_compat.TESTED}): "
            "update that module and the trainers that use it")


def _listed(table: dict, base: str) -> dict[str, tuple[str, ...]]:
    return table.get(base, {})


def _sources(classes) -> str:
    return "\n".join(inspect.getsource(c) for c in classes)


def _trl_classes(base: str):
    return [c for c in getattr(trl, base).__mro__ if c.__module__.startswith("trl.")]


def _our_modules(cls):
    """The library's modules that define `cls` and its bases (the code that runs as that trainer)."""
    names = {c.__module__ for c in cls.__mro__ if c.__module__.startswith("hf_blockdiag_cp")}
    return [inspect.getmodule(c) for c in cls.__mro__ if c.__module__ in names]


ASSIGNED = r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)"


# --------------------------------------------------------------------------- names and signatures


@pytest.mark.parametrize("table", ["OVERRIDDEN", "CALLED"])
def test_each_private_method_keeps_its_parameters(table):
    for base, methods in getattr(trl_compat, table).items():
        for name, parameters in methods.items():
            method = getattr(getattr(trl, base), name, None)
            assert callable(method), _changed(f"{base}.{name} is gone")
            found = tuple(inspect.signature(method).parameters)[1:]
            assert found == parameters, _changed(f"{base}.{name} takes {found}, not {parameters}")


@pytest.mark.parametrize("base", sorted(OURS))
def test_every_override_of_a_trl_method_is_listed_and_takes_what_trl_passes(base):
    """A method of ours that TRL's trainer defines (and `transformers.Trainer` does not) is an override
    of TRL's own code: it must be listed in OVERRIDDEN, marked `@overrides`, and accept TRL's call (the
    parameters without a default by position, the others by keyword)."""
    cls, trl_class = OURS[base], getattr(trl, base)
    mine = {name: value for klass in reversed(cls.__mro__) if klass.__module__.startswith("hf_blockdiag_cp")
            for name, value in vars(klass).items() if callable(value)}
    overridden = {name for name in mine if hasattr(trl_class, name) and not hasattr(transformers.Trainer, name)}
    assert overridden == set(_listed(trl_compat.OVERRIDDEN, base)), _changed(
        f"{cls.__name__} overrides {sorted(overridden)} of {base}; compat.trl.OVERRIDDEN lists "
        f"{sorted(_listed(trl_compat.OVERRIDDEN, base))}")
    for name in overridden:
        marked = getattr(mine[name], "__trl_overrides__", ())
        assert base in marked, f"{cls.__name__}.{name} is not marked @overrides({base!r})"
        theirs = inspect.signature(getattr(trl_class, name)).parameters.values()
        positional = [None] * (1 + sum(p.default is inspect.Parameter.empty for p in theirs if p.name != "self"))
        keywords = {p.name: None for p in theirs if p.default is not inspect.Parameter.empty}
        try:
            inspect.signature(mine[name]).bind(*positional, **keywords)
        except TypeError as exc:
            pytest.fail(_changed(f"{cls.__name__}.{name} cannot take {base}'s call: {exc}"))


@pytest.mark.parametrize("base", sorted(OURS))
def test_every_trl_attribute_we_read_is_listed_and_set_by_trl(base):
    """The attributes of TRL's trainer (set by its code, not by the Trainer's or ours) that our trainer's
    code reads are ATTRIBUTES, OVERRIDDEN or CALLED; each ATTRIBUTES entry is still set by TRL."""
    cls = OURS[base]
    theirs = _sources(_trl_classes(base))
    set_by_trl = set(re.findall(ASSIGNED, theirs)) | {n for c in _trl_classes(base) for n in vars(c)}
    set_by_trainer = set(re.findall(ASSIGNED, inspect.getsource(transformers.Trainer))) | set(dir(transformers.Trainer))
    code = "\n".join(inspect.getsource(m) for m in _our_modules(cls))
    code += "\n" + inspect.getsource(trl_compat).replace("trainer.", "self.")  # prepare_like_trl's reads
    set_by_us = set(re.findall(ASSIGNED, code)) | {n for c in cls.__mro__ if c.__module__.startswith("hf_blockdiag_cp")
                                                    for n in vars(c)}
    read = set(re.findall(r"\bself\.(\w+)", code))
    trl_only = (read & set_by_trl) - set_by_trainer - set_by_us
    listed = set(trl_compat.ATTRIBUTES[base]) | set(_listed(trl_compat.OVERRIDDEN, base)) | set(
        _listed(trl_compat.CALLED, base))
    assert trl_only <= listed, _changed(f"{cls.__name__} reads {sorted(trl_only - listed)} of {base}, not listed in "
                                        "compat.trl (ATTRIBUTES, OVERRIDDEN or CALLED)")
    for name in trl_compat.ATTRIBUTES[base]:
        assert name in set_by_trl, _changed(f"{base} no longer sets self.{name}")


def test_log_probs_result_has_trls_arity():
    for base in ("GRPOTrainer", "RLOOTrainer"):
        returned = typing.get_type_hints(getattr(trl, base)._get_per_token_logps_and_entropies)["return"]
        assert typing.get_origin(returned) is tuple and len(typing.get_args(returned)) == len(trl_compat.LOGPS_RESULT), \
            _changed(f"{base}._get_per_token_logps_and_entropies returns {returned}, not {trl_compat.LOGPS_RESULT}")
    assert len(trl_compat.logps_result(1, 2)) == len(trl_compat.LOGPS_RESULT)


def test_overrides_refuses_a_method_not_listed():
    with pytest.raises(TypeError, match="OVERRIDDEN does not list"):
        @trl_compat.overrides("DPOTrainer")
        def _compute_something(self):
            pass


def test_trl_prepares_a_dataset_as_for_evaluation(tmp_path):
    """`prepare_like_trl` on a stock SFTTrainer: text becomes TRL's packed rows (input_ids, seq_lengths)."""
    from trl import SFTTrainer

    from helpers.sft import char_tokenizer, sft_config, sft_dataset
    from helpers.trainer import tiny_model

    trainer = SFTTrainer(model=tiny_model("sdpa"), args=sft_config(str(tmp_path)), train_dataset=sft_dataset("text"),
                         processing_class=char_tokenizer())
    try:
        prepared = trl_compat.prepare_like_trl(trainer, sft_dataset("text"), "test")
    except (AttributeError, TypeError) as exc:
        pytest.fail(_changed(f"SFTTrainer's dataset preparation changed: {exc!r}"))
    assert {"input_ids", "seq_lengths"} <= set(prepared.column_names), _changed(
        f"SFTTrainer._prepare_dataset gave columns {prepared.column_names}")
    assert len(prepared) < len(sft_dataset("text")), "the documents were not packed"


# --------------------------------------------------------------------------- the version line


def _build(kind: str, out: str):
    """One of our five trainers, cp = 1, on the tests' tiny models and data."""
    from helpers.preference import (
        char_tokenizer, dpo_config, policy_model, preference_dataset, preference_rows, reference_model,
        reward_classifier, reward_config,
    )
    from helpers.rl import prompt_rows, rl_config

    rows = preference_rows(count=2)
    if kind == "sft":
        from helpers.sft import sft_config, sft_dataset
        from helpers.trainer import tiny_model

        return ours.BlockdiagCPSFTTrainer(model=tiny_model(), args=sft_config(out), train_dataset=sft_dataset("text"),
                                          processing_class=char_tokenizer())
    if kind == "dpo":
        policy = policy_model("llama", "blockdiag_cp")
        return ours.BlockdiagCPDPOTrainer(model=policy, ref_model=reference_model(policy), args=dpo_config(out, 1),
                                          train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                          max_tokens=1024)
    if kind == "reward":
        return ours.BlockdiagCPRewardTrainer(model=reward_classifier("llama", "blockdiag_cp"), args=reward_config(out, 1),
                                             train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                             max_tokens=1024)
    cls = ours.BlockdiagCPGRPOTrainer if kind == "grpo" else ours.BlockdiagCPRLOOTrainer
    return cls(model=policy_model("llama", "blockdiag_cp"), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
               args=rl_config(kind, out, beta=0.0), train_dataset=preference_dataset(prompt_rows()),
               processing_class=char_tokenizer())


def _version_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "were verified with TRL" in r.getMessage()]


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward", "grpo", "rloo"])
def test_an_unverified_trl_is_named_in_one_line(kind, monkeypatch, caplog):
    from hf_blockdiag_cp.comm.notice import forget
    from helpers.trainer import accelerate_env

    monkeypatch.setattr(trl, "__version__", "1.99.0")
    message = trl_compat.unverified_message()
    forget(("trl version", message))
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"), accelerate_env(0, 1) as out:
        _build(kind, out)
        _build(kind, out)  # once per process
    lines = _version_lines(caplog)
    assert lines == [message], lines
    assert "TRL 1.99.0 is installed" in message and all(v in message for v in trl_compat.VERIFIED)
    assert "\n" not in message


def test_a_verified_trl_says_nothing(monkeypatch, caplog):
    from helpers.trainer import accelerate_env

    monkeypatch.setattr(trl, "__version__", trl_compat.VERIFIED[-1])
    assert trl_compat.unverified_message() is None
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"), accelerate_env(0, 1) as out:
        _build("dpo", out)
    assert _version_lines(caplog) == []
