"""The `meshplan` command line (also `python -m meshplan`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

MODELS = ("gpt", "llama")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan", description="Auto-parallel planner for PyTorch: plan, print and run shardings."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="plan a small model, print the plan, run it on local gloo processes and check parity",
        description="Plan a small model for --devices devices, print the plan, run it on that many "
        "local gloo processes for --steps training steps and report parity with one process.",
    )
    demo.add_argument("--devices", type=_positive_int, default=4, help="number of local processes (default 4)")
    demo.add_argument("--steps", type=_positive_int, default=3, help="training steps to run (default 3)")
    demo.add_argument("--model", choices=MODELS, default="gpt", help="which small model (default gpt)")
    demo.set_defaults(handler=_demo)
    return parser


def _demo(args: argparse.Namespace) -> object:
    from meshplan.demo import run_demo  # lazy: keeps `meshplan --help` fast

    return run_demo(devices=args.devices, steps=args.steps, model=args.model)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.handler(args)
    if isinstance(result, bool):  # a check that passed or failed
        return 0 if result else 1
    return result if isinstance(result, int) else 0
