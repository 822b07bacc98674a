"""Every complete Python example of README.md (each ```python block is one) runs as written on CPU
under `torchrun --standalone --nproc-per-node 2` (all in one launch, one after the other), with only
`"your/model"` replaced by a tiny local Llama saved with `save_pretrained`; the quick start also as
`python train.py`, one process (a CP
group of one; its `__main__` run in the test's process). Checks appended per section compare with
an independent reference: the quick start's CP loss, averaged over the CP group, equals the stock
eager model's token-weighted loss over each document of the pack alone; the Trainer example trains
as one 2-process run, and its sharded `evaluate()` (on the first 64 of its documents) equals the
stock eager model with the trained weights on each document alone (the two ranks run half the
documents each and add their sums). A Trainer launched by torchrun on CPU without `use_cpu=True`
stops with an error that names the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _torchrun(script: Path, cwd: Path) -> tuple[int, str]:
    """Run `script` under torchrun with 2 processes."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = subprocess.run(
        [sys.executable, *launcher, str(script)],
        cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), capture_output=True, text=True,
        timeout=600,
    )
    return run.returncode, run.stdout + run.stderr


def _example_script(tmp_path: Path, heading: str, code: str, model: str | None = None, name: str = "example.py",
                    done: str = "done") -> Path:
    """The example with the tiny model and its section's checks; each rank leaves a file `{done}{rank}` when
    it finished (printed lines of two ranks can interleave)."""
    model = model or _tiny_model(tmp_path / "tiny")
    marker = f'open({str(tmp_path)!r} + "/{done}" + __import__("os").environ.get("RANK", "0"), "w").write("{DONE}")\n'
    script = tmp_path / name
    script.write_text(f"MODEL = {model!r}\n" + code.replace('"your/model"', "MODEL") + CHECKS.get(heading, "") + marker)
    return script


def test_readme_holds_the_checked_examples():
    assert set(CHECKS) <= {heading for heading, _ in python_examples()}, python_examples()


def test_readme_examples_run_under_torchrun_on_cpu(tmp_path):
    """All examples in one torchrun launch (each interpreter started costs seconds of imports): every
    rank runs each example's file as `python file` runs it (`runpy`: its own namespace and
    `sys.argv`), the quick start last, as its check ends the process group. So the quick start's
    `init_parallel` joins the group the Trainer example's TrainingArguments started; starting one under
    torchrun is what train_packed.py's `init_parallel` does in test_train_example.py."""
    if torch.cuda.is_available():
        pytest.skip("runs the CPU path: the examples pick CUDA when it is there")
    examples = sorted(python_examples(), key=lambda example: example[0] == "Quick start")
    model = _tiny_model(tmp_path / "tiny")
    files = []
    for i, (heading, code) in enumerate(examples):
        assert '"your/model"' in code, f"the {heading} example loads no model to replace"
        files.append(str(_example_script(tmp_path, heading, code, model, f"example{i}.py", f"done{i}-")))
    driver = tmp_path / "run_examples.py"
    driver.write_text(f"import runpy, sys\n\nfor path in {files!r}:\n    sys.argv = [path]\n"
                      "    runpy.run_path(path, run_name='__main__')\n")
    rc, out = _torchrun(driver, tmp_path)
    assert rc == 0, out[-3000:]
    finished = sorted(p.name for p in tmp_path.glob("done*"))
    assert finished == [f"done{i}-{rank}" for i in range(len(files)) for rank in (0, 1)], (finished, out[-3000:])


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


def test_trainer_without_use_cpu_on_cpu_names_the_fix(tmp_path):
    """torchrun's 2 processes on a host without CUDA: without use_cpu=True transformers would run
    each process alone; the Trainer must stop on every rank and say to pass use_cpu=True."""
    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA")
    code = dict(python_examples())["Trainer"]
    assert code.count("    use_cpu=not torch.cuda.is_available(),") == 1
    script = tmp_path / "example.py"
    script.write_text(f"MODEL = {_tiny_model(tmp_path / 'tiny')!r}\n"
                      + code.replace('"your/model"', "MODEL").replace("    use_cpu=not torch.cuda.is_available(),", ""))
    rc, out = _torchrun(script, tmp_path)
    assert rc != 0
    expected = ("ValueError: the launcher started 2 processes (WORLD_SIZE=2), but TrainingArguments sees world size 1: "
                "each process would train alone. This host has no CUDA")
    assert sum(expected in line and "use_cpu=True" in line for line in out.splitlines()) == 2, out[-3000:]
