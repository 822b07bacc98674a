"""The package's layers (docs/design.md, "Package layout"): each depends only on those below it,
planning imports neither torch.distributed nor any other layer (not even `compat`, the upstream
internals), and the root exports the user's names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hf_blockdiag_cp
import hf_blockdiag_cp.model_patches

PACKAGE = Path(hf_blockdiag_cp.__file__).parent
REPO = Path(__file__).resolve().parents[2]
# model_patches/ is a top-level folder of the repository installed as hf_blockdiag_cp.model_patches.
PATCHES = Path(hf_blockdiag_cp.model_patches.__file__).parent
# Bottom up; a module may import its own layer and the layers before it.
LAYERS = ["registry", "compat", "planning", "comm", "kernels", "config", "step", "attention", "mixers", "model_patches", "logprobs",
          "data", "integrations", "bench"]
BELOW = {
    "registry": set(),  # the one generic registry of records (pure Python); every layer may use it
    "compat": set(),  # the upstream internals the library reads; every layer but the pure planning may use it
    "planning": set(),
    "comm": {"compat", "planning"},
    "kernels": {"compat", "planning"},
    "config": {"compat", "planning", "comm", "kernels"},
    "step": {"compat", "planning", "comm", "kernels", "config"},
    "attention": {"compat", "planning", "comm", "kernels", "step"},
    "mixers": {"compat", "planning", "comm", "kernels", "config", "step"},
    "model_patches": {"compat", "planning", "comm", "kernels", "config", "step", "attention", "mixers"},
    "logprobs": {"compat", "planning", "comm", "kernels", "config", "step"},
    "data": {"compat", "config", "planning", "comm", "step"},
    "integrations": {"compat", "planning", "comm", "kernels", "config", "step", "attention", "mixers", "model_patches",
                     "logprobs", "data"},
    "bench": set(LAYERS) - {"bench"} | {"root"},  # the benchmarks use the package as a user does
}
for _layer in LAYERS[1:]:
    BELOW[_layer] = BELOW[_layer] | {"registry"}
# Inside kernels/, the two kinds are independent of each other.
KERNEL_KINDS = ("attention", "mixers")


def _modules():
    """(layer, dotted module parts, path) of every module of the installed package, model patches included."""
    for root, prefix in ((PACKAGE, ("hf_blockdiag_cp",)), (PATCHES, ("hf_blockdiag_cp", "model_patches"))):
        for path in sorted(root.rglob("*.py")):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            if len(parts) == 2 and parts[1] == "__init__":
                continue  # the package root may import every layer
            yield parts[1].removesuffix(".py"), parts, path


def _imported_layers(parts: tuple[str, ...], path: Path) -> set[tuple[str, str]]:
    """(layer, full module name) of every hf_blockdiag_cp import in `path`, top-level and in-function."""
    found = set()
    package = parts[:-1]  # the package a relative import starts from
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
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
            elif bits[0] == "model_patches":
                found.add(("top-level model_patches", n))
            elif bits[0] in ("torch",) and n.startswith("torch.distributed"):
                found.add(("torch.distributed", n))
    return found


def test_layers_depend_only_downward():
    wrong = []
    for layer, parts, path in _modules():
        for target, name in _imported_layers(parts, path):
            if target == "torch.distributed":
                if layer == "planning":
                    wrong.append(f"{'.'.join(parts)} imports {name} (planning is pure)")
                continue
            if target != layer and target not in BELOW[layer]:
                wrong.append(f"{'.'.join(parts)} ({layer}) imports {name} ({target})")
    assert wrong == []


def test_kernel_kinds_do_not_import_each_other():
    wrong = []
    for layer, parts, path in _modules():
        if layer != "kernels" or len(parts) < 4 or parts[2] not in KERNEL_KINDS:
            continue
        for _, name in _imported_layers(parts, path):
            bits = name.split(".")
            if bits[1:2] == ["kernels"] and len(bits) > 2 and bits[2] in KERNEL_KINDS and bits[2] != parts[2]:
                wrong.append(f"{'.'.join(parts)} imports {name}")
    assert wrong == []
    assert {parts[2] for layer, parts, _ in _modules() if layer == "kernels" and len(parts) > 3} >= set(KERNEL_KINDS)


def test_the_runtime_never_imports_bench():
    """bench/ is an optional subpackage (the CLI and calibration, docs/design.md): importing the library and
    its integrations must not load it."""
    import subprocess
    import sys

    code = ("import sys, hf_blockdiag_cp, hf_blockdiag_cp.integrations.trainer, hf_blockdiag_cp.integrations.trl; "
            "print(sorted(m for m in sys.modules if m.startswith('hf_blockdiag_cp.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_no_runtime_module_names_bench():
    """Nor can a later path load it: the package root imports no bench module, and no runtime module names
    it in a string (an `importlib.import_module` by name); the layers below bench never import it
    (test_layers_depend_only_downward)."""
    root = PACKAGE / "__init__.py"
    assert not {name for _, name in _imported_layers(("hf_blockdiag_cp", "__init__"), root) if ".bench" in name}
    named = [".".join(parts) for layer, parts, path in _modules() if layer != "bench"
             and re.search(r"[\"']hf_blockdiag_cp\.bench|[\"']\.bench[\"'.]", path.read_text())]
    assert named == []


def test_model_patches_install_inside_the_package():
    assert hf_blockdiag_cp.model_patches.__name__ == "hf_blockdiag_cp.model_patches"
    assert hf_blockdiag_cp.apply_model_patches is hf_blockdiag_cp.model_patches.apply_model_patches
    assert any(layer == "model_patches" for layer, _, _ in _modules())


def test_root_exports_the_users_names_only():
    """The root holds the user's names, so each is documented for users (README.md or docs/); a name
    only the library's own modules need belongs in its subpackage."""
    text = "".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))])
    undocumented = [name for name in hf_blockdiag_cp.__all__ if not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text)]
    assert undocumented == [], "root names that README.md and docs/ never mention"
    for name in hf_blockdiag_cp.__all__:
        assert getattr(hf_blockdiag_cp, name) is not None
    for seed_name in ("make_cp_blockdiag_batch_and_ctx", "configure_cp_varlen", "cp_blockdiag_sdpa", "shard_batch",
                      "BlockdiagCpModelState", "current_blockdiag_cp_state", "BlockdiagCPTrainer", "BlockdiagCPCallback"):
        assert hasattr(hf_blockdiag_cp, seed_name)
