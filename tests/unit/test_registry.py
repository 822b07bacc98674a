"""The one generic registry (hf_blockdiag_cp/registry.py) and what every record kind gets from it:
spellings, `auto` order and the reasons it passed records over, the `BDCP_DISABLE_<NAME>` opt-out
(docs/gpu.md), and import errors of an installed but broken package kept in the refusal."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from hf_blockdiag_cp.kernels import MixerDims, choose_kernel, choose_mixer_kernel
from hf_blockdiag_cp.kernels.mixers import fla
from hf_blockdiag_cp.planning import canonical_exchange_name, exchange_names, layout_strategies
from hf_blockdiag_cp.registry import Registry, UnavailableError, disable_variable, optional_import


@dataclass(frozen=True)
class Record:
    name: str
    aliases: tuple[str, ...] = ()
    auto_priority: int | None = None
    refuse: str | None = None


def _registry() -> Registry[Record]:
    registry = Registry("widget_backend", "a widget")
    registry.register(Record("slow", auto_priority=10))
    registry.register(Record("fast", aliases=("Quick-One",), auto_priority=0, refuse="needs a GPU"))
    registry.register(Record("manual"))
    return registry


def test_spellings_order_and_choice():
    registry = _registry()
    assert registry.names() == ("slow", "fast", "manual")
    assert registry.canonical(" quick_one ") == "fast" and registry.canonical("AUTO") == "auto"
    assert [r.name for r in registry.auto_order()] == ["fast", "slow"]  # manual: only when named
    check = lambda r: r.refuse  # noqa: E731
    assert registry.choose("auto", check).name == "slow"
    assert registry.choose("manual", check).name == "manual"
    with pytest.raises(UnavailableError, match="widget_backend='fast' cannot run here: needs a GPU"):
        registry.choose("fast", check)
    with pytest.raises(ValueError, match="widget_backend='bogus' is not a widget; available: slow, fast, manual"):
        registry.get("bogus")
    with pytest.raises(ValueError, match=r"widget_backend='nope' is not supported; accepted values: auto, slow, fast, manual"):
        registry.canonical("nope")
    with pytest.raises(ValueError, match="the spelling 'quick_one' already names 'fast'"):
        registry.register(Record("other", aliases=("quick-one",)))
    with pytest.raises(ValueError, match="the spelling 'auto' already names the per-step choice"):
        registry.register(Record("auto"))
    assert registry.unregister("fast").name == "fast" and "fast" not in registry
    with pytest.raises(ValueError):
        registry.canonical("quick_one")


def test_auto_names_every_refusal():
    registry = _registry()
    with pytest.raises(UnavailableError, match="widget_backend='auto' found no widget on cpu: fast: needs a GPU; slow: off"):
        registry.choose("auto", lambda r: r.refuse or "off", where="on cpu")


def test_every_setting_uses_one_registry():
    """Exchanges and layouts answer through the same class as the kernels."""
    from hf_blockdiag_cp.kernels.attention.registry import KERNELS
    from hf_blockdiag_cp.planning.exchange_registry import EXCHANGES
    from hf_blockdiag_cp.planning.layout import LAYOUTS

    assert all(isinstance(r, Registry) for r in (KERNELS, EXCHANGES, LAYOUTS))
    assert EXCHANGES.names() == exchange_names() and LAYOUTS.names() == layout_strategies()
    assert canonical_exchange_name("All-Gather".replace("-", "")) == "allgather"


def test_environment_switches_a_record_off(monkeypatch):
    """BDCP_DISABLE_FLA: `auto` passes over every fla record (here on a simulated verified GPU) and a
    request for fla says which variable refused it; the same for an attention kernel."""
    monkeypatch.setattr(fla, "fla_device", lambda device: (None, 9))
    cuda, dims = torch.device("cuda"), MixerDims(128, 128)
    assert choose_mixer_kernel("gated_delta_rule", "auto", cuda, torch.bfloat16, dims).name == "fla"
    assert disable_variable("fla") == "BDCP_DISABLE_FLA"
    monkeypatch.setenv("BDCP_DISABLE_FLA", "1")
    assert choose_mixer_kernel("gated_delta_rule", "auto", cuda, torch.bfloat16, dims).name == "torch"
    with pytest.raises(UnavailableError, match="mixer_backend='fla' cannot run gated_delta_rule here: switched off by BDCP_DISABLE_FLA=1"):
        choose_mixer_kernel("gated_delta_rule", "fla", cuda, torch.bfloat16, dims)
    monkeypatch.setenv("BDCP_DISABLE_FLA", "0")
    assert choose_mixer_kernel("gated_delta_rule", "auto", cuda, torch.bfloat16, dims).name == "fla"

    cpu = torch.device("cpu")
    assert choose_kernel("auto", cpu, torch.float32, 16, 16).name == "dense"  # the only kernel auto takes on a CPU
    monkeypatch.setenv("BDCP_DISABLE_DENSE", "true")
    with pytest.raises(UnavailableError, match="found no attention kernel .* dense: switched off by BDCP_DISABLE_DENSE=true"):
        choose_kernel("auto", cpu, torch.float32, 16, 16)
    assert choose_kernel("flex", cpu, torch.float32, 16, 16).name == "flex"


def test_a_broken_install_shows_its_import_error(tmp_path, monkeypatch):
    """An installed package that raises on import is told apart from a missing one, with its error."""
    package = tmp_path / "bdcp_broken_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    optional_import.cache_clear()
    try:
        assert optional_import("bdcp_broken_pkg") == (
            None, "installed, but importing it raised ImportError: libcuda.so.1: cannot open shared object file")
        assert optional_import("bdcp_not_a_package_anywhere") == (None, "not installed")
        assert optional_import("json", "dumps")[0] is sys.modules["json"].dumps
    finally:
        optional_import.cache_clear()


def test_fa4_refusal_names_the_import_error(tmp_path, monkeypatch):
    """A flash_attn whose `cute` module raises: the fa4 refusal carries that error, not "install the extra"."""
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (cute / "__init__.py").write_text("raise RuntimeError('CUDA DSL needs a driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    optional_import.cache_clear()
    try:
        with pytest.raises(UnavailableError, match="importing it raised RuntimeError: CUDA DSL needs a driver"):
            choose_kernel("fa4", torch.device("cuda"), torch.bfloat16, 128, 128)
    finally:
        optional_import.cache_clear()
