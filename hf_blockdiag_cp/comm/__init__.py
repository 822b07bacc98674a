"""Communication over the CP group: differentiable K/V exchanges (`exchange`), the per-step
consensus all-reduce (`consensus`), failure handling (`failure`) and group resolution (`group`)."""

from .consensus import Agreement, agree, checksum, collective_device
from .exchange import EXCHANGES, ExchangeMeter, exchange_kv
from .failure import check_group_usable, fail_group
from .group import CPGroup, group_spans_nodes, resolve_cp_group

__all__ = [
    "EXCHANGES",
    "Agreement",
    "CPGroup",
    "ExchangeMeter",
    "agree",
    "check_group_usable",
    "checksum",
    "collective_device",
    "exchange_kv",
    "fail_group",
    "group_spans_nodes",
    "resolve_cp_group",
]
