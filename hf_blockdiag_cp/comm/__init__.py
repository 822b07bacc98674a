"""Communication over the CP group: the K/V exchanges (one record each under `exchanges`, the
shared transport pieces and `exchange_kv` in `exchange`), the per-step consensus all-reduce
(`consensus`), failure handling (`failure`), group resolution (`group`) and the
dp_replicate × dp_shard × cp × tp grid and its meshes (`parallel_dims`: `ParallelDims`; `mesh`
keeps the deprecated dp × cp names for one release)."""

from . import exchanges  # noqa: F401  (registers the exchange records)
from .consensus import Agreement, agree, checksum, collective_device
from .exchange import ExchangeMeter, exchange_kv
from .failure import check_group_usable, fail_group
from .group import CPGroup, group_spans_nodes, resolve_cp_group
from .mesh import DPCPCoordinates, DPCPMesh, build_dp_cp_mesh  # deprecated aliases (one release)
from .parallel_dims import ParallelDims, ParallelMesh

__all__ = [
    "Agreement",
    "CPGroup",
    "DPCPCoordinates",
    "DPCPMesh",
    "ExchangeMeter",
    "ParallelDims",
    "ParallelMesh",
    "agree",
    "build_dp_cp_mesh",
    "check_group_usable",
    "checksum",
    "collective_device",
    "exchange_kv",
    "fail_group",
    "group_spans_nodes",
    "resolve_cp_group",
]
