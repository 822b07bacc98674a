"""A `torch.compile` backend for the compile tests: each graph is compiled by a registered backend
(`aot_eager`, `inductor`), and the backend keeps what the graph calls and how often it ran. A test
can so tell that a step ran compiled code, also code that dynamo reuses from an earlier model of the
same case (one backend object per case: dynamo's cache entries belong to their backend)."""

from __future__ import annotations

from torch._dynamo.backends.registry import lookup_backend


class RecordingBackend:
    """`torch.compile(backend=RecordingBackend("aot_eager"))`: `graphs` holds, per compiled graph, its
    call targets (`ops`) and the number of times it ran (`calls`, forward only)."""

    def __init__(self, backend: str = "aot_eager"):
        self.inner = lookup_backend(backend)
        self.graphs: list[dict] = []

    def __call__(self, gm, example_inputs):
        graph = {"ops": {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}, "calls": 0}
        self.graphs.append(graph)
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            graph["calls"] += 1
            return compiled(*args)

        if getattr(compiled, "_boxed_call", False):  # dynamo passes one list to such a function
            run._boxed_call = True
        return run

    def calls(self) -> list[int]:
        """How often each graph compiled so far has run: compare two of these with `ran_between`."""
        return [g["calls"] for g in self.graphs]

    def ran_between(self, before: list[int], after: list[int]) -> list[dict]:
        """The graphs that ran between two `calls()` (a graph compiled in between counts if it ran)."""
        before = before + [0] * (len(after) - len(before))
        return [g for g, b, a in zip(self.graphs, before, after) if a > b]
