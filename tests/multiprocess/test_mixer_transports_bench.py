"""`benchmarks/mixer_transports.py` measures what it names: each row's transport is the one the
step ran (a step configured for it, `CPConfig.mixer_transport`), on two real gloo ranks, with the
bytes of `planning.mixer_plan.transport_bytes` and the choice of `auto` beside it."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def transports_case(rank, world_size, group, argv):
    """The benchmark's rows of this CP size, measured in the pool's group."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import mixer_transports

    return mixer_transports.measure(rank, world_size, group, mixer_transports.parser().parse_args(argv))


def test_each_row_runs_the_transport_it_names(gloo):
    argv = ["--device", "cpu", "--dtype", "float32", "--small", "--seq-lens", "512", "--mean-doc-len", "64", "--calls", "1"]
    rows = gloo(2).run(transports_case, timeout=300, argv=argv)[0]
    for pack in ("lognormal", "one_doc"):
        measured = {row["transport"]: row for row in rows if row["pack"] == pack}
        assert sorted(measured) == ["heads", "states"], pack
        for transport, row in measured.items():
            assert f"transport={transport}" in row["ran"].split(), row
            assert row["ms_per_layer"] > 0 and row["auto_chooses"] in ("heads", "states"), row
        # state passing moves one state per run boundary; head-parallel moves every row's activations
        assert measured["states"]["mib_per_layer"] < measured["heads"]["mib_per_layer"], measured
