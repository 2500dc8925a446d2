"""The `meshplan` command line (also `python -m meshplan`): plan, show, explain, diff, report, code, ops, clusters,
demo, profile (compute | comm | show), validate.

Every command but `plan`, `code`, `ops` and `demo` reads only the plan file. Bad input exits with status 2
and one line on stderr naming what was given and what is allowed; `plan` checks its flags before it builds
the model. This module imports nothing heavy at the top: `--help`, `--version` and the commands that read a
plan file load only what they use.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from meshplan.cli.models import FACTORY_FORMS, hf_model, load_factory

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


class _Version(argparse.Action):
    """`--version`, read from the installed metadata only when asked (importing importlib.metadata costs every
    other command time)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the versions of meshplan and torch")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import version

        print(f"meshplan {version('meshplan')} (torch {version('torch')})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan", description="Auto-parallel planner for PyTorch: plan, print, explain, compare and run shardings."
    )
    parser.add_argument("--version", action=_Version)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="log progress (-vv: debug)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "plan", parents=[common], help="plan a model, print the plan and save it",
        description="Plan the model that FACTORY builds (MODULE:FACTORY, e.g. meshplan.models:gpt_small, or "
        "path/file.py:FACTORY), or the Hugging Face model of a config.json (--hf), print the plan and save it (--out). "
        "FACTORY() returns (model, example_inputs), (model, example_inputs, example_kwargs), or a model with an "
        "example_inputs() method.",
    )
    _add_model_arguments(p)
    p.add_argument("--devices", type=_positive_int, required=True, help="number of devices to plan for")
    p.add_argument("--mesh", type=parse_mesh, help="mesh shape such as 8x8 (default: try every shape of up to 3 axes whose inner axis fits in a node)")
    p.add_argument("--axis-names", help="comma-separated mesh axis names (default dp / dp,tp / dp0,dp1,tp)")
    p.add_argument("--cluster", help="hardware preset, any case (`meshplan clusters` lists them; default cpu, or h100 with CUDA)")
    p.add_argument("--memory", type=parse_size, help="per-device memory budget such as 80GB or 80GiB")
    p.add_argument("--profile", help="measured profile JSON (or 'local': this machine's, see `meshplan profile`)")
    p.add_argument("--mode", default="auto", help="auto, data_parallel, semi_auto or manual (default auto)")
    p.add_argument("--inputs", default="global", help="global or local (default global)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds each mesh's solve may take (default 60); a plan stopped by it is labelled not proven optimal")
    p.add_argument("--mixed-precision", default="auto",
                   help="bf16 (compute in bf16, fp32 master weights), fp32, or auto (default): bf16 where the cluster's device has a bf16 peak above its fp32 one")
    p.add_argument("--out", "-o", help="plan file to write (JSON; default: print the plan only)")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(handler=_plan)

    s = commands.add_parser("show", parents=[common], help="print a plan file", description="Print a saved plan.")
    s.add_argument("plan")
    s.add_argument("--ops", action="store_true", help="also list every costly op and every op whose inputs move")
    s.add_argument("--json", action="store_true", help="print the summary's figures and facts as JSON (no tables)")
    s.set_defaults(handler=_show)

    e = commands.add_parser(
        "explain", parents=[common], help="why a node got its strategy",
        description="The chosen strategy of NODE (a module path, parameter FQN or node name), the alternatives with "
        "their cost deltas, and what ruled others out.",
    )
    e.add_argument("plan")
    e.add_argument("node", metavar="NODE")
    e.add_argument("--json", action="store_true", help="print the explanation as JSON")
    e.set_defaults(handler=_explain)

    d = commands.add_parser("diff", parents=[common], help="compare two plan files", description="What changed from plan A to plan B and what it costs.")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true", help="print the differences as JSON")
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
    _add_model_arguments(c)
    c.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    c.set_defaults(handler=_code)

    _add_ops_command(commands, common)
    k = commands.add_parser(
        "clusters", parents=[common], help="list the hardware presets --cluster takes",
        description="The hardware presets the cost model prices plans with, and their key figures.",
    )
    k.set_defaults(handler=_clusters)

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
    _add_profile_parser(commands, common)
    v = commands.add_parser(
        "validate", parents=[common], help="cost-model fidelity: predicted vs measured time and memory of several plans",
        description="Calibrate (unless --profile is given), plan a small GPT with DP, FSDP, TP, DPxTP and HSDP "
        "on 2 and 4 local gloo processes, measure each, and print predicted vs measured step time and peak memory, "
        "Spearman rank correlation and median errors (docs/cost_model.md).",
    )
    v.add_argument("--profile", help="use this profile instead of measuring one (a path, or 'local')")
    v.add_argument("--save-profile", help="write the calibration profile here")
    v.add_argument("--quick", action="store_true", help="a tiny model and two plans on 2 processes (smoke test)")
    v.add_argument("--steps", type=_positive_int, default=16, help="timed steps per plan (default 16)")
    v.set_defaults(handler=_validate)
    return parser


def _add_profile_parser(commands, common) -> None:
    prof = commands.add_parser(
        "profile", parents=[common], help="measure op times (compute) or collectives (comm) into a profile JSON",
        description="Measure this machine and write (merge into) a profile that `meshplan.plan(..., profile=PATH)` and "
        "`meshplan plan --profile PATH` read. --out local (the default) is this machine's entry in the profile "
        "database ($MESHPLAN_PROFILE_DIR or ~/.cache/meshplan/profiles).",
    )
    what = prof.add_subparsers(dest="what", metavar="WHAT", required=True)
    c = what.add_parser("compute", parents=[common], help="time every op shape a model's candidate plans run",
                        description="Time, forward and backward, every distinct (op, local shapes, dtype) of the candidate "
                        "strategies of the model FACTORY builds, on every mesh of each --devices count.")
    _add_model_arguments(c)
    c.add_argument("--devices", type=_positive_int, nargs="+", default=[2, 4], help="device counts to plan for (default 2 4)")
    c.add_argument("--cluster", default="cpu", help="the cluster preset the profile calibrates (default cpu)")
    c.add_argument("--out", "-o", default="local", help="profile file to write or merge into (default: local)")
    c.set_defaults(handler=_profile_compute)
    m = what.add_parser("comm", parents=[common], help="fit alpha-beta per collective and mesh axis",
                        description="Run all_reduce, all_gather, reduce_scatter, all_to_all and send/recv on every axis of "
                        "every 1-D and 2-D mesh over message sizes 4 KiB..256 MiB and fit alpha + bytes*beta. Under torchrun "
                        "it measures the launched group; otherwise --local N starts N gloo processes here.")
    m.add_argument("--local", type=_positive_int, nargs="+", metavar="N", help="world sizes to run locally (default 2 4)")
    m.add_argument("--quick", action="store_true", help="4 KiB, 64 KiB and 1 MiB only (CI)")
    m.add_argument("--max-size", type=parse_size, help="largest message (default 256MiB; e.g. 16MiB on a small machine)")
    m.add_argument("--reps", type=_positive_int, default=5, help="timed repetitions per size (default 5)")
    m.add_argument("--cluster", default="cpu", help="the cluster preset the profile calibrates (default cpu, or h100 with CUDA)")
    m.add_argument("--out", "-o", default="local", help="profile file to write or merge into (default: local)")
    m.set_defaults(handler=_profile_comm)
    s = what.add_parser("show", parents=[common], help="summarise a profile file", description="Summarise a profile file.")
    s.add_argument("path", nargs="?", default="local", help="profile file (default: local)")
    s.set_defaults(handler=_profile_show)


# ---------------------------------------------------------------- helpers


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODULE:FACTORY", nargs="?", help=f"{FACTORY_FORMS} (or --hf)")
    p.add_argument("--hf", metavar="CONFIG", help="a Hugging Face config.json (or its directory): plan the causal LM it "
                   "describes, built on the meta device (needs --batch and --seq)")
    p.add_argument("--batch", type=_positive_int, help="with --hf: sequences per step")
    p.add_argument("--seq", type=_positive_int, help="with --hf: tokens per sequence")


def check_model_args(args: argparse.Namespace) -> None:
    """The model is named once: a factory or --hf, with the inputs --hf needs."""
    if (args.target is None) == (args.hf is None):
        given = f"both {args.target!r} and --hf {args.hf!r}" if args.target else "neither"
        raise ValueError(f"give the model as {FACTORY_FORMS}, or as --hf CONFIG; got {given}")
    if args.hf is not None and (args.batch is None or args.seq is None):
        raise ValueError(f"--hf needs --batch B and --seq S (the example inputs); got --batch {args.batch}, --seq {args.seq}")
    if args.hf is None and (args.batch is not None or args.seq is not None):
        raise ValueError("--batch and --seq go with --hf; a factory returns its own example inputs")


def build_model(args: argparse.Namespace):
    """(model, example_inputs, example_kwargs) of the factory or the --hf config."""
    check_model_args(args)
    return load_factory(args.target) if args.hf is None else hf_model(args.hf, args.batch, args.seq)


def cluster_name(name: str | None) -> str | None:
    """`H100` -> 'h100': a preset named in any case (None, the default, stays None)."""
    if name is None:
        return None
    from meshplan.cost_model.presets import CLUSTERS

    if name.lower() not in CLUSTERS:
        raise ValueError(f"--cluster {name!r} is not a preset; allowed (any case): {', '.join(sorted(CLUSTERS))}")
    return name.lower()


def check_plan_args(args: argparse.Namespace) -> None:
    """What `plan` can check before it builds and traces the model, which takes seconds to minutes."""
    check_model_args(args)
    if args.out is not None:
        check_writable(args.out)
    args.cluster = cluster_name(args.cluster)
    from meshplan.ir.precision import CHOICES
    from meshplan.planner.planner import INPUT_MODES, MODES

    for flag, value, allowed in (("--mode", args.mode, MODES), ("--inputs", args.inputs, INPUT_MODES),
                                 ("--mixed-precision", args.mixed_precision, CHOICES)):
        if value not in allowed:
            raise ValueError(f"{flag} {value!r} is not supported; allowed: {', '.join(allowed)}")


def check_writable(path: str) -> None:
    """`path` can be written: its directory exists and takes files, and it is no directory itself."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--out {path!r} is a directory; give a file name such as {os.path.join(path, 'plan.json')}")
    if not os.path.isdir(directory):
        raise ValueError(f"--out {path!r}: directory {directory} does not exist; create it or write elsewhere")
    if not os.access(directory, os.W_OK):
        raise ValueError(f"--out {path!r}: directory {directory} is not writable")


def read_plan(path: str):
    from meshplan.plans.plan import Plan

    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read plan file {path!r}: {e.strerror}") from None
    return Plan.from_json(text)


# ---------------------------------------------------------------- commands


def _plan(args: argparse.Namespace) -> int:
    import warnings

    check_plan_args(args)
    import meshplan
    from meshplan.cli.progress import enabled
    from meshplan.progress import phase

    kwargs: dict = {}
    if args.memory is not None:
        kwargs["memory_budget"] = args.memory
    kwargs["time_limit_s"] = args.time_limit
    kwargs["mixed_precision"] = args.mixed_precision
    if args.profile is not None:
        kwargs["profile"] = args.profile
    if args.axis_names:
        kwargs["axis_names"] = tuple(a.strip() for a in args.axis_names.split(","))
    show = not args.no_progress and sys.stderr.isatty()
    source = args.target or f"--hf {args.hf}"
    with enabled(f"meshplan plan {source}", show=show):
        phase(f"building the model ({source})")
        model, inputs, example_kwargs = build_model(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            the_plan = meshplan.plan(
                model, args.devices, inputs, example_kwargs=example_kwargs, mesh_shape=args.mesh, cluster=args.cluster,
                mode=args.mode, inputs=args.inputs, **kwargs,
            )
        if args.out is not None:
            phase(f"writing {args.out}")
            try:
                the_plan.save(args.out)
            except OSError as e:
                raise ValueError(f"cannot write plan file {args.out!r}: {e.strerror}") from None
    print(the_plan.summary())
    where = f"saved to {args.out}" if args.out is not None else "not saved, no --out given"
    print(f"\nplan {where} (hash {the_plan.hash()})")
    return 0


def _show(args: argparse.Namespace) -> int:
    the_plan = read_plan(args.plan)
    if args.json:
        from meshplan.inspect.summary import summary_dict

        return _print_json(summary_dict(the_plan))
    print(the_plan.summary(ops=args.ops))
    return 0


def _explain(args: argparse.Namespace) -> int:
    explanation = read_plan(args.plan).explain(args.node)
    if args.json:
        return _print_json(explanation.to_dict())
    print(explanation)
    return 0


def _diff(args: argparse.Namespace) -> int:
    differences = read_plan(args.a).diff(read_plan(args.b))
    if args.json:
        return _print_json(differences.to_dict())
    print(differences)
    return 0


def _print_json(data: dict) -> int:
    import json

    print(json.dumps(data, indent=1))
    return 0


def _report(args: argparse.Namespace) -> int:
    path = read_plan(args.plan).report(args.out)
    print(f"report written to {path}")
    return 0


def _code(args: argparse.Namespace) -> int:
    from meshplan.inspect.code import plan_code

    the_plan = read_plan(args.plan)
    model, inputs, kwargs = build_model(args)
    print(plan_code(the_plan, model, inputs, rank=args.rank, example_kwargs=kwargs))
    return 0


def _add_ops_command(commands, common) -> None:
    o = commands.add_parser(
        "ops", parents=[common], help="list a model's ops with their sharding-rule source and FLOP share",
        description="Trace the model FACTORY builds (MODULE:FACTORY) and list every op with the source of its sharding "
        "rule (dtensor, meshplan, fallback), its share of the forward FLOPs and whether any candidate splits its work; "
        "nothing is planned or run.",
    )
    _add_model_arguments(o)
    o.add_argument("--mesh", type=parse_mesh, default=(2,), help="mesh shape the candidates are listed for (default 2)")
    o.add_argument("--min-share", type=float, default=0.0, help="only ops with at least this fraction of the FLOPs (e.g. 0.01)")
    o.add_argument("--views", action="store_true", help="also list view ops (reshape, transpose, ...)")
    o.set_defaults(handler=_ops)


def _ops(args: argparse.Namespace) -> int:
    from meshplan.inspect.ops import list_ops

    if not 0.0 <= args.min_share <= 1.0:
        raise ValueError(f"--min-share must be a fraction between 0 and 1, got {args.min_share}")
    model, inputs, kwargs = build_model(args)
    print(list_ops(model, inputs, example_kwargs=kwargs, mesh_shape=args.mesh).format(min_share=args.min_share, views=args.views))
    return 0


def _clusters(args: argparse.Namespace) -> int:
    from meshplan.cost_model.memory import format_bytes
    from meshplan.cost_model.presets import CLUSTERS

    def link(preset) -> str:
        return f"{preset.name} {preset.bandwidth / 1e9:g} GB/s"

    rows = [("cluster", "device", "per node", "memory", "fp32 TFLOP/s", "bf16 TFLOP/s", "memory GB/s", "within a node", "between nodes")]
    for name, c in sorted(CLUSTERS.items()):
        d = c.device
        rows.append((name, d.name, str(c.devices_per_node), format_bytes(d.memory_bytes), f"{d.peak('float32') / 1e12:g}",
                     f"{d.peak('bfloat16') / 1e12:g}", f"{d.memory_bandwidth / 1e9:g}", link(c.intra_node), link(c.inter_node)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print("\n--cluster takes any of these names, in any case; without it plans use h100 where CUDA is available, else cpu.")
    return 0


def _demo(args: argparse.Namespace) -> object:
    from meshplan.cli.demo import run_demo  # lazy: keeps `meshplan --help` fast

    return run_demo(devices=args.devices, steps=args.steps, model=args.model)


def _profile_compute(args: argparse.Namespace) -> int:
    from meshplan.profiling.calibrate import profile_model

    args.cluster = cluster_name(args.cluster)
    model, inputs, kwargs = build_model(args)
    profile = profile_model(model, inputs, tuple(args.devices), example_kwargs=kwargs, cluster=args.cluster, out=args.out)
    print(profile.summary())
    print(f"written to {_profile_out(args.out)}")
    return 0


def _profile_comm(args: argparse.Namespace) -> int:
    from meshplan.profiling.calibrate import profile_comm, profile_comm_torchrun
    from meshplan.profiling.comm_profiler import FULL_SIZES, QUICK_SIZES
    from meshplan.runtime.launch import is_torchrun

    args.cluster = cluster_name(args.cluster)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.max_size is not None:
        sizes = tuple(s for s in sizes if s <= args.max_size)
        if len(sizes) < 2:
            raise ValueError(f"--max-size {args.max_size} leaves fewer than 2 message sizes; allowed: >= {FULL_SIZES[1]} bytes")
    if is_torchrun():
        if args.local:
            raise ValueError("--local starts its own processes; under torchrun leave it out (the launched group is measured)")
        profile = profile_comm_torchrun(cluster=args.cluster, sizes=sizes, reps=args.reps, out=args.out)
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return 0
    else:
        profile = profile_comm(tuple(args.local or (2, 4)), cluster=args.cluster, sizes=sizes, reps=args.reps, out=args.out)
    print(profile.summary())
    for f in profile.collectives:
        bw = f"{1 / f.seconds_per_byte / 1e6:,.0f} MB/s" if f.seconds_per_byte else "inf"
        print(f"  {f.kind:<14} group {f.group} of world {f.world} ({f.axis}): alpha {f.alpha_s * 1e6:,.0f} us, {bw}")
    print(f"written to {_profile_out(args.out)}")
    return 0


def _profile_show(args: argparse.Namespace) -> int:
    from meshplan.cost_model.profile import load_profile

    print(load_profile(_profile_out(args.path)).summary())
    return 0


def _validate(args: argparse.Namespace) -> int:
    from meshplan.profiling import fidelity

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    profile = args.profile or fidelity.calibrate(quick=args.quick, out=args.save_profile, log=say)
    # a profile measured now is refreshed next to each world's steps; a given one is used as it is
    rows = fidelity.run(profile, quick=args.quick, steps=args.steps, refresh_comm=not args.profile, log=say)
    print(fidelity.table(rows))
    return 0


def _profile_out(out: str) -> str:
    from meshplan.cost_model.profile import profile_path

    return str(profile_path()) if out == "local" else out


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
