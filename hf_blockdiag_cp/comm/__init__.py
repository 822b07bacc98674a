"""Communication over the CP group: the K/V exchanges (one record each under `exchanges`, the
shared transport pieces and `exchange_kv` in `exchange`), the per-step consensus all-reduce
(`consensus`), failure handling (`failure`), group resolution (`group`) and the dp × cp
placement and mesh (`mesh`)."""

from . import exchanges  # noqa: F401  (registers the exchange records)
from .consensus import Agreement, agree, checksum, collective_device
from .exchange import ExchangeMeter, exchange_kv
from .failure import check_group_usable, fail_group
from .group import CPGroup, group_spans_nodes, resolve_cp_group
from .mesh import DPCPCoordinates, DPCPMesh, build_dp_cp_mesh

__all__ = [
    "Agreement",
    "CPGroup",
    "DPCPCoordinates",
    "DPCPMesh",
    "ExchangeMeter",
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
