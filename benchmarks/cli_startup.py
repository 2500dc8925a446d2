"""How fast the command line answers (issue 31): `--help`, `--version` and the commands that read a plan file.

    python benchmarks/cli_startup.py [--rounds 7]

Each case is a fresh `python -m meshplan ...` process of this checkout, timed wall to wall. The baseline is
`python -c "import torch"` timed alongside: the cases run interleaved, one of each per round in an order
that rotates from round to round, so background load hits all alike. Printed: each case's median, its
ratio to torch's, and its target:
- `--help` and `--version`: at most 1.5 s (they import no torch);
- `show`, `diff` and `explain` on plan files: at most torch's import time + 1 s (they import the plan data
  and its readers, never the planner or the runtime; tests/test_cli.py checks that part). The plan data's
  placements are DTensor's classes, so `import torch.distributed.tensor` is timed too: the floor of these three.

The plan files are planned first (the small MLP for 2 and 2 x 2 devices), not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this checkout
MESHPLAN = [sys.executable, "-m", "meshplan"]

CASES = {
    "import torch": ([sys.executable, "-c", "import torch"], None),
    "import meshplan": ([sys.executable, "-c", "import meshplan"], None),
    # a plan's placements are DTensor's own classes (ir/placement.py): reading one imports this package
    "import torch.distributed.tensor": ([sys.executable, "-c", "import torch.distributed.tensor"], None),
    "meshplan --help": ([*MESHPLAN, "--help"], ("at most", 1.5)),
    "meshplan --version": ([*MESHPLAN, "--version"], ("at most", 1.5)),
    "meshplan show a.json": ([*MESHPLAN, "show", "a.json"], ("torch +", 1.0)),
    "meshplan diff a.json b.json": ([*MESHPLAN, "diff", "a.json", "b.json"], ("torch +", 1.0)),
    "meshplan explain b.json layers.1": ([*MESHPLAN, "explain", "b.json", "layers.1"], ("torch +", 1.0)),
}
"""name -> (command, target): at most N seconds, or at most torch's median + N seconds."""


def run(cmd: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="runs of each case (default 7)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for out, extra in (("a.json", []), ("b.json", ["--mesh", "2x2"])):
            run([*MESHPLAN, "plan", "meshplan.models:mlp_small", "--devices", "4" if extra else "2", *extra, "--out", out], d)
        names = list(CASES)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                times[n].append(run(CASES[n][0], d))
    median = {n: statistics.median(t) for n, t in times.items()}
    torch_s = median["import torch"]
    print(f"CLI startup: median of {args.rounds} interleaved runs per case, seconds ({os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at the end)")
    for n in names:
        line = f"  {n:<34} {median[n]:6.2f} s  x{median[n] / torch_s:.2f} torch (min {min(times[n]):.2f}, max {max(times[n]):.2f})"
        target = CASES[n][1]
        if target is not None:
            kind, limit = target
            bound = limit if kind == "at most" else torch_s + limit
            met = "met" if median[n] <= bound else "NOT met"
            line += f"; target <= {limit:g} s" if kind == "at most" else f"; torch + {median[n] - torch_s:.2f} s, target <= torch + {limit:g} s"
            line += f": {met}"
        print(line)


if __name__ == "__main__":
    main()
