"""README.md's quick start runs as written on CPU under `torchrun --standalone --nproc-per-node 2`
(only the model id is replaced by a tiny local Llama), and its CP loss, averaged over the CP
group, equals the stock eager model's token-weighted loss over each document of the pack alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Appended to the quick start: the independent reference, on every rank.
CHECK = '''
import torch.nn.functional as F

cp_loss = loss.detach().clone()
dist.all_reduce(cp_loss, group=cp_mesh.get_group())
cp_loss = cp_loss.item() / cp
reference = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager", dtype=torch.float32)
ids, total, targets, start = input_ids[0].cpu(), 0.0, 0, 0
for n in lengths:
    doc = ids[start : start + n]
    start += n
    total += F.cross_entropy(reference(input_ids=doc[None]).logits[0, :-1], doc[1:], reduction="sum").item()
    targets += n - 1
assert abs(cp_loss - total / targets) <= 1e-5 * abs(total / targets), (cp_loss, total / targets)
print("quick start loss", cp_loss, "reference", total / targets)
dist.destroy_process_group()
'''


def quick_start_code() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Quick start\n", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]


def test_quick_start_runs_on_cpu_and_matches_the_per_document_loss(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    code = quick_start_code()
    assert code.count('"your/model"') == 1
    script = tmp_path / "train.py"
    script.write_text(f"MODEL = {str(tmp_path / 'tiny')!r}\n" + code.replace('"your/model"', "MODEL") + CHECK)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), capture_output=True,
        text=True, timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert out.count("quick start loss") == 2, out[-3000:]
