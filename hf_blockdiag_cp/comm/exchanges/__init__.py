"""The exchanges, one module each, each registering its `ExchangeRecord` in
`planning.exchange_registry` (whose docstring says how to add one): `allgather` (every rank's
rows to every rank), `halo` (the needed rows from left neighbours, point-to-point), `a2a`
(the needed rows by one all-to-all-v), and the head-parallel `heads` (q, k, v to head shards and
the outputs back, two all-to-alls around the kernel)."""

# Each registers its record; the order of these lines is the order CPConfig lists the names in.
from . import allgather  # noqa: F401,I001
from . import halo  # noqa: F401
from . import a2a  # noqa: F401
from . import heads  # noqa: F401
