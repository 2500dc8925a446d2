"""The `meshplan` command line (also `python -m meshplan`): plan, show, explain, diff, report, code, ops, demo.

Every command but `plan`, `code`, `ops` and `demo` reads only the plan file. Bad input exits with status 2
and one line on stderr naming what was given and what is allowed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
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


def parse_mesh(text: str) -> tuple[int, ...]:
    """`8x8` -> (8, 8)."""
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not a shape like 8 or 8x8 (positive ints joined by x)")
    return tuple(int(p) for p in parts)


def parse_size(text: str) -> int:
    """`80GB` -> 80e9 bytes, `80GiB` -> 80 * 2**30, `1024` -> 1024 (meshplan's own `parse_bytes`)."""
    from meshplan.cost_model.memory import parse_bytes

    try:
        return parse_bytes(int(text) if text.strip().isdigit() else text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan", description="Auto-parallel planner for PyTorch: plan, print, explain, compare and run shardings."
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="log progress (-vv: debug)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "plan", parents=[common], help="plan a model and save the plan file",
        description="Plan the model that FACTORY builds (MODULE:FACTORY, e.g. meshplan.models:gpt_small) and save the plan. "
        "FACTORY() returns (model, example_inputs), (model, example_inputs, example_kwargs), or a model with an "
        "example_inputs() method.",
    )
    p.add_argument("target", metavar="MODULE:FACTORY")
    p.add_argument("--devices", type=_positive_int, required=True, help="number of devices to plan for")
    p.add_argument("--mesh", type=parse_mesh, help="mesh shape such as 8x8 (default: try every shape of up to 3 axes whose inner axis fits in a node)")
    p.add_argument("--axis-names", help="comma-separated mesh axis names (default dp / dp,tp / dp0,dp1,tp)")
    p.add_argument("--cluster", help="hardware preset (see meshplan.cost_model.presets.CLUSTERS; default cpu, or h100 with CUDA)")
    p.add_argument("--memory", type=parse_size, help="per-device memory budget such as 80GB or 80GiB")
    p.add_argument("--mode", default="auto", help="auto, data_parallel, semi_auto or manual (default auto)")
    p.add_argument("--inputs", default="global", help="global or local (default global)")
    p.add_argument("--out", "-o", required=True, help="plan file to write (JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(handler=_plan)

    s = commands.add_parser("show", parents=[common], help="print a plan file", description="Print a saved plan.")
    s.add_argument("plan")
    s.add_argument("--ops", action="store_true", help="also list every costly op and every op whose inputs move")
    s.set_defaults(handler=_show)

    e = commands.add_parser(
        "explain", parents=[common], help="why a node got its strategy",
        description="The chosen strategy of NODE (a module path, parameter FQN or node name), the alternatives with "
        "their cost deltas, and what ruled others out.",
    )
    e.add_argument("plan")
    e.add_argument("node", metavar="NODE")
    e.set_defaults(handler=_explain)

    d = commands.add_parser("diff", parents=[common], help="compare two plan files", description="What changed from plan A to plan B and what it costs.")
    d.add_argument("a")
    d.add_argument("b")
    d.set_defaults(handler=_diff)

    r = commands.add_parser("report", parents=[common], help="write a self-contained HTML report", description="Write an HTML report of a plan.")
    r.add_argument("plan")
    r.add_argument("-o", "--out", required=True, help="HTML file to write")
    r.set_defaults(handler=_report)

    c = commands.add_parser(
        "code", parents=[common], help="print the program one rank runs",
        description="Print the per-rank program of a plan with its collectives; needs the model it was planned for.",
    )
    c.add_argument("plan")
    c.add_argument("target", metavar="MODULE:FACTORY")
    c.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    c.set_defaults(handler=_code)

    _add_ops_command(commands, common)

    demo = commands.add_parser(
        "demo", parents=[common],
        help="plan a small model, print the plan, run it on local gloo processes and check parity",
        description="Plan a small model for --devices devices, print the plan, run it on that many "
        "local gloo processes for --steps training steps and report parity with one process.",
    )
    demo.add_argument("--devices", type=_positive_int, default=4, help="number of local processes (default 4)")
    demo.add_argument("--steps", type=_positive_int, default=3, help="training steps to run (default 3)")
    demo.add_argument("--model", choices=MODELS, default="gpt", help="which small model (default gpt)")
    demo.set_defaults(handler=_demo)
    return parser


# ---------------------------------------------------------------- helpers


def load_factory(target: str):
    """`MODULE:FACTORY` -> (model, example_inputs, example_kwargs)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY such as meshplan.models:gpt_small; got {target!r}")
    if os.getcwd() not in sys.path:  # the console script does not put the working directory on the path
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {target!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {attr!r}; callables there: {', '.join(_callables(module)) or 'none'}")
    made = factory()
    from torch import nn

    if isinstance(made, nn.Module):
        if not callable(getattr(made, "example_inputs", None)):
            raise ValueError(f"{target} returned a model without an example_inputs() method; return (model, example_inputs) instead")
        made = (made, made.example_inputs())
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        raise ValueError(
            f"{target} returned {type(made).__name__}; allowed: (model, example_inputs), (model, example_inputs, "
            "example_kwargs) or a model with an example_inputs() method"
        )
    model, inputs = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else None
    return model, inputs if isinstance(inputs, tuple) else (inputs,), kwargs


def _callables(module) -> list[str]:
    return sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:12]


def read_plan(path: str):
    from meshplan.planner.plan import Plan

    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read plan file {path!r}: {e.strerror}") from None
    return Plan.from_json(text)


# ---------------------------------------------------------------- commands


def _plan(args: argparse.Namespace) -> int:
    import warnings

    import meshplan
    from meshplan.progress import enabled, phase

    kwargs: dict = {}
    if args.memory is not None:
        kwargs["memory_budget"] = args.memory
    if args.axis_names:
        kwargs["axis_names"] = tuple(a.strip() for a in args.axis_names.split(","))
    show = not args.no_progress and sys.stderr.isatty()
    with enabled(f"meshplan plan {args.target}", show=show):
        phase(f"building the model ({args.target})")
        model, inputs, example_kwargs = load_factory(args.target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            the_plan = meshplan.plan(
                model, args.devices, inputs, example_kwargs=example_kwargs, mesh_shape=args.mesh, cluster=args.cluster,
                mode=args.mode, inputs=args.inputs, **kwargs,
            )
        phase(f"writing {args.out}")
        try:
            the_plan.save(args.out)
        except OSError as e:
            raise ValueError(f"cannot write plan file {args.out!r}: {e.strerror}") from None
    print(the_plan.summary())
    print(f"\nplan saved to {args.out} (hash {the_plan.hash()})")
    return 0


def _show(args: argparse.Namespace) -> int:
    print(read_plan(args.plan).summary(ops=args.ops))
    return 0


def _explain(args: argparse.Namespace) -> int:
    print(read_plan(args.plan).explain(args.node))
    return 0


def _diff(args: argparse.Namespace) -> int:
    print(read_plan(args.a).diff(read_plan(args.b)))
    return 0


def _report(args: argparse.Namespace) -> int:
    path = read_plan(args.plan).report(args.out)
    print(f"report written to {path}")
    return 0


def _code(args: argparse.Namespace) -> int:
    from meshplan.inspect.code import plan_code

    the_plan = read_plan(args.plan)
    model, inputs, kwargs = load_factory(args.target)
    print(plan_code(the_plan, model, inputs, rank=args.rank, example_kwargs=kwargs))
    return 0


def _add_ops_command(commands, common) -> None:
    o = commands.add_parser(
        "ops", parents=[common], help="list a model's ops with their sharding-rule source and FLOP share",
        description="Trace the model FACTORY builds (MODULE:FACTORY) and list every op with the source of its sharding "
        "rule (dtensor, meshplan, fallback), its share of the forward FLOPs and whether any candidate splits its work; "
        "nothing is planned or run.",
    )
    o.add_argument("target", metavar="MODULE:FACTORY")
    o.add_argument("--mesh", type=parse_mesh, default=(2,), help="mesh shape the candidates are listed for (default 2)")
    o.add_argument("--min-share", type=float, default=0.0, help="only ops with at least this fraction of the FLOPs (e.g. 0.01)")
    o.add_argument("--views", action="store_true", help="also list view ops (reshape, transpose, ...)")
    o.set_defaults(handler=_ops)


def _ops(args: argparse.Namespace) -> int:
    from meshplan.inspect.ops import list_ops

    if not 0.0 <= args.min_share <= 1.0:
        raise ValueError(f"--min-share must be a fraction between 0 and 1, got {args.min_share}")
    model, inputs, kwargs = load_factory(args.target)
    print(list_ops(model, inputs, example_kwargs=kwargs, mesh_shape=args.mesh).format(min_share=args.min_share, views=args.views))
    return 0


def _demo(args: argparse.Namespace) -> object:
    from meshplan.demo import run_demo  # lazy: keeps `meshplan --help` fast

    return run_demo(devices=args.devices, steps=args.steps, model=args.model)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        result = args.handler(args)
    except ValueError as e:  # bad input: one line, no traceback
        print(f"meshplan {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `meshplan show plan.json | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if isinstance(result, bool):  # a check that passed or failed
        return 0 if result else 1
    return result if isinstance(result, int) else 0
