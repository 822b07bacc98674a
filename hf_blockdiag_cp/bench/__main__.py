"""`python -m hf_blockdiag_cp.bench {kernels,model,ranks,scaling} [options]` (also `hf-blockdiag-cp-bench`).

`kernels`, `model` and `ranks` measure GPU kernels: each prints a markdown table and writes JSON,
the table and a PNG plot to `--out`. `scaling` runs on any machine: it reads the JSON of a
multi-GPU run and of `bench kernels` and predicts larger CP sizes (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import sys

from . import kernels, model, ranks, scaling

SUBCOMMANDS = {"kernels": kernels, "model": model, "ranks": ranks, "scaling": scaling}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hf-blockdiag-cp-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    args.argv = argv  # the command line, for the outputs that quote it
    if getattr(args, "device", None) == "cuda" and not getattr(args, "calibrate_from", None):
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"bench {args.command} measures GPU kernels and needs a CUDA device")
    status = SUBCOMMANDS[args.command].main(args)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
