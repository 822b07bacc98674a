"""The package's layers (docs/design.md, "Package layout"): each depends only on those below it,
planning imports neither torch.distributed nor any other layer, and the root exports the user's names."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_blockdiag_cp

PACKAGE = Path(hf_blockdiag_cp.__file__).parent
# Bottom up; a module may import its own layer and the layers before it.
LAYERS = ["config", "planning", "comm", "kernels", "step", "attention", "data", "integrations", "bench"]
BELOW = {
    "planning": set(),
    "comm": {"planning"},
    "kernels": {"planning"},
    "config": {"planning", "kernels"},
    "step": {"planning", "comm", "kernels", "config"},
    "attention": {"planning", "comm", "kernels", "step"},
    "data": {"config", "planning", "step"},
    "integrations": {"planning", "comm", "kernels", "config", "step", "attention", "data"},
    "bench": set(LAYERS) - {"bench"} | {"root"},  # the benchmarks use the package as a user does
}


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _imported_layers(path: Path) -> set[tuple[str, str]]:
    """(layer, full module name) of every hf_blockdiag_cp import in `path`, top-level and in-function."""
    found = set()
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - node.level])
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] + ([f"{name}.{a.name}" for a in node.names] if name == "hf_blockdiag_cp" else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            bits = n.split(".")
            if bits[0] == "hf_blockdiag_cp" and len(bits) > 1:
                found.add((bits[1] if bits[1] in LAYERS else "root", n))
            elif bits[0] in ("torch",) and n.startswith("torch.distributed"):
                found.add(("torch.distributed", n))
    return found


def test_layers_depend_only_downward():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer == "__init__":
            continue
        for target, name in _imported_layers(path):
            if target == "torch.distributed":
                if layer == "planning":
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name} (planning is pure)")
                continue
            if target != layer and target not in BELOW[layer]:
                wrong.append(f"{path.relative_to(PACKAGE)} ({layer}) imports {name} ({target})")
    assert wrong == []


def test_root_exports_the_users_names_only():
    assert len(hf_blockdiag_cp.__all__) <= 20
    for name in hf_blockdiag_cp.__all__:
        assert getattr(hf_blockdiag_cp, name) is not None
    for seed_name in ("make_cp_blockdiag_batch_and_ctx", "configure_cp_varlen", "cp_blockdiag_sdpa", "shard_batch",
                      "BlockdiagCpModelState", "current_blockdiag_cp_state", "BlockdiagCPTrainer", "BlockdiagCPCallback"):
        assert hasattr(hf_blockdiag_cp, seed_name)
