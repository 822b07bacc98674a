"""`python -m hf_blockdiag_cp.bench {kernels,model,ranks} [options]` (also `hf-blockdiag-cp-bench`).

Each subcommand prints a markdown table, and writes JSON, the table and a PNG plot to `--out`.
"""

from __future__ import annotations

import argparse
import sys

from . import kernels, model, ranks

SUBCOMMANDS = {"kernels": kernels, "model": model, "ranks": ranks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-blockdiag-cp-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available() and not getattr(args, "calibrate_from", None):
        sys.exit(f"bench {args.command} measures GPU kernels and needs a CUDA device")
    SUBCOMMANDS[args.command].main(args)


if __name__ == "__main__":
    main()
