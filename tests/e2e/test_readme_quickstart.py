"""Every complete Python example of README.md (each ```python block is one) runs as written on CPU
under `torchrun --standalone --nproc-per-node 2` (the e2e tests' shared launch, `helpers.launch`),
with only `"your/model"` replaced by a tiny local Llama saved with `save_pretrained`; the quick
start also as `python train.py`, one process (a CP group of one; its `__main__` run in the test's
process). Checks appended per section compare with an independent reference: the quick start's CP
loss, averaged over the CP group, equals the stock eager model's token-weighted loss over each
document of the pack alone; the Trainer example trains as one 2-process run, and its sharded
`evaluate()` (on the first 64 of its documents) equals the stock eager model with the trained
weights on each document alone (the two ranks run half the documents each and add their sums). A
Trainer launched by torchrun on CPU without `use_cpu=True` stops with an error that names the fix."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from helpers.launch import Run
from helpers.scripts import run_in_process

ROOT = Path(__file__).resolve().parents[2]
DONE = "README example done on rank"

# The stock eager model's token-weighted loss over `documents` (1-D id tensors), each alone; with
# `group`, each rank of it runs every world-size-th document and the sums are added over the group.
REFERENCE = '''
import torch.nn.functional as F


def reference_loss(model, documents, group=None):
    import torch.distributed as dist

    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for doc in documents[rank::size]:
            sums[0] += F.cross_entropy(model(input_ids=doc[None]).logits[0, :-1], doc[1:], reduction="sum").item()
            sums[1] += doc.numel() - 1
    if group is not None:
        dist.all_reduce(sums, group=group)
    return (sums[0] / sums[1]).item()
'''

# Appended to a section's example, on every rank.
CHECKS = {
    "Quick start": REFERENCE + '''
import torch.distributed as dist

assert cp_mesh.size() == int(__import__("os").environ.get("WORLD_SIZE", "1")), cp_mesh  # cp = the processes
cp_loss = loss.detach().clone()
dist.all_reduce(cp_loss, group=cp_mesh.get_group())
cp_loss = cp_loss.item() / cp_mesh.size()
reference = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager", dtype=torch.float32)
want = reference_loss(reference, input_ids[0].cpu().split(lengths))
assert abs(cp_loss - want) <= 1e-5 * want, (cp_loss, want)
dist.destroy_process_group()
''',
    "Trainer": REFERENCE + '''
assert trainer.args.world_size == 2, f"the 2 processes trained alone: world size {trainer.args.world_size}"
logged = [h["step"] for h in trainer.state.log_history if "loss" in h]
assert logged == list(range(args.logging_steps, args.max_steps + 1, args.logging_steps)), trainer.state.log_history
eval_docs = docs[:64]  # 16 to 1,007 tokens each, 32,272 in all: 16 or more packs of 2,048
metrics = trainer.evaluate(eval_dataset=eval_docs)
reference = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager", dtype=torch.float32)
reference.load_state_dict(trainer.model.state_dict())  # the trained weights
import torch.distributed as dist  # the Trainer's process group: the documents split over the 2 ranks

want = reference_loss(reference, [torch.tensor(d["input_ids"]) for d in eval_docs], dist.group.WORLD)
assert abs(metrics["eval_loss"] - want) <= 1e-5 * want, (metrics["eval_loss"], want)
''',
}


def python_examples() -> list[tuple[str, str]]:
    """(section heading, code) of every ```python block of README.md, in order."""
    parts = re.split(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    examples, heading = [], None
    for i, part in enumerate(parts):  # text, code, text, code, ..., text
        if i % 2:
            examples.append((heading, part))
        else:
            heading = ([heading] + re.findall(r"^## (.+)$", part, flags=re.M))[-1]
    return examples


def _tiny_model(path: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    # One layer of 2 query heads over 1 K/V head (GQA): in the Trainer example's 80 packs of 2,048 tokens
    # every head of every layer scores 1,024 x 2,048 pairs on each rank, most of the test's time.
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _example_script(folder: Path, heading: str, code: str) -> Path:
    """`folder`/example.py: the example with a tiny model saved in `folder` and its section's checks; each
    rank leaves a file `done<rank>` in `folder` when it finished (its last line)."""
    model = _tiny_model(folder / "tiny")
    marker = f'open({str(folder)!r} + "/done" + __import__("os").environ.get("RANK", "0"), "w").write("{DONE}")\n'
    script = folder / "example.py"
    script.write_text(f"MODEL = {model!r}\n" + code.replace('"your/model"', "MODEL") + CHECKS.get(heading, "") + marker)
    return script


def test_readme_holds_the_checked_examples():
    assert set(CHECKS) <= {heading for heading, _ in python_examples()}, python_examples()


USE_CPU = "    use_cpu=not torch.cuda.is_available(),"


def _without_use_cpu(folder: Path) -> Path:
    """The Trainer example with the tiny model and without its `use_cpu` line."""
    code = dict(python_examples())["Trainer"].replace(USE_CPU, "")
    script = folder / "example.py"
    script.write_text(f"MODEL = {_tiny_model(folder / 'tiny')!r}\n" + code.replace('"your/model"', "MODEL"))
    return script


# Each example a run of the shared launch: every rank runs its file as `python file` runs it (`runpy`:
# its own namespace and `sys.argv`), each from a process with no process group, as a new one.
README_RUNS = tuple(Run(f"readme-{i}", functools.partial(_example_script, heading=heading, code=code))
                    for i, (heading, code) in enumerate(python_examples()))
NO_USE_CPU_RUN = Run("readme-trainer-without-use_cpu", _without_use_cpu, raises=True)
ON_CUDA = "runs the CPU path: the examples pick CUDA when it is there"


@pytest.mark.skipif(torch.cuda.is_available(), reason=ON_CUDA)
@pytest.mark.launched(*README_RUNS)
def test_readme_examples_run_under_torchrun_on_cpu(launch):
    """Every example ends on both ranks of the launch, its checks passed (starting a process group
    under torchrun from the quick start's `init_parallel` is also what train_packed.py does in
    test_train_example.py)."""
    for run, (heading, code) in zip(README_RUNS, python_examples()):
        assert '"your/model"' in code, f"the {heading} example loads no model to replace"
        result = launch.result(run)
        result.assert_ok(f"the README's {heading} example")
        finished = sorted(p.name for p in result.folder.glob("done*"))
        assert finished == ["done0", "done1"], (heading, finished, result.text[-3000:])


def test_quick_start_runs_as_one_process(monkeypatch, capsys, tmp_path):
    """`python train.py`: one process is a CP group of one, and the loss is the per-document reference's.
    Run in this process (the script as `__main__`, no launcher variables): no interpreter to start."""
    if torch.cuda.is_available():
        pytest.skip("runs the CPU path: the examples pick CUDA when it is there")
    script = _example_script(tmp_path, "Quick start", dict(python_examples())["Quick start"])
    monkeypatch.chdir(tmp_path)
    status, out, err = run_in_process(monkeypatch, capsys, script, [], {}, process_group=True)
    assert status in (None, 0), (out + err)[-3000:]
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0"], (out + err)[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.launched(NO_USE_CPU_RUN)
def test_trainer_without_use_cpu_on_cpu_names_the_fix(launch):
    """torchrun's 2 processes on a host without CUDA: without use_cpu=True transformers would run
    each process alone; the Trainer must stop on every rank and say to pass use_cpu=True (each rank's
    error is caught by the launch, which goes on)."""
    assert dict(python_examples())["Trainer"].count(USE_CPU) == 1
    result = launch.result(NO_USE_CPU_RUN)
    expected = ("ValueError: the launcher started 2 processes (WORLD_SIZE=2), but TrainingArguments sees world size 1: "
                "each process would train alone. This host has no CUDA")
    for rank, status in enumerate(result.statuses):
        assert status["status"] == "raised", (rank, status, result.logs[rank][-3000:])
        assert status["error"].startswith(expected) and "use_cpu=True" in status["error"], (rank, status)
