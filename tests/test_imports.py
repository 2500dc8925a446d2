"""The import graph: no circles between meshplan's packages, nor between its files.

Every import counts, wherever it is written: at the top, inside a function (lazy) or under
`TYPE_CHECKING`. A circle means two concepts cannot be read, tested or moved apart."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import meshplan

PACKAGE = Path(__file__).resolve().parents[1] / "meshplan"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> nx.DiGraph:
    """module -> the meshplan modules it imports (a `from package import name` counts the submodule `name` where there is one;
    the root package's public names, which load on first use, count as imports of the modules named in its `_EXPORTS`)."""
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_edges_from(("meshplan", m) for m in set(meshplan._EXPORTS.values()))
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("meshplan") and target != name:
                    graph.add_edge(name, target)
    return graph


def _package(module: str) -> str:
    """meshplan.<package> for a module inside a package; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def test_no_circles_between_files():
    graph = import_graph()
    files = graph.subgraph(m for m in graph if not _modules()[m].name == "__init__.py")
    circles = sorted(sorted(c) for c in nx.simple_cycles(files))
    assert not circles, f"import circles between files: {circles}"


def test_no_circles_between_packages():
    graph = import_graph()
    packages = nx.DiGraph()
    for a, b in graph.edges:
        pa, pb = _package(a), _package(b)
        if pa != pb and "meshplan" not in (pa, pb):  # the root package imports everything it exports
            packages.add_edge(pa, pb, via=(a, b))
    circles = [[(x, packages.edges[x, y]["via"]) for x, y in zip(c, c[1:] + c[:1])] for c in nx.simple_cycles(packages)]
    assert not circles, f"import circles between packages (package, one import that makes the arrow): {circles}"
    # and nothing the root package imports (it imports every package to export the API) imports the root back
    back = sorted(a for a in nx.descendants(graph, "meshplan") if graph.has_edge(a, "meshplan"))
    assert not back, f"{back} import the meshplan package, which imports them: import the module you need"


def test_the_graph_sees_lazy_and_type_checking_imports():
    """The graph is only as good as its parser: the Plan's reading methods are attached by the root, not imported by
    the data layer, and this file's own view of a known lazy import and a TYPE_CHECKING one is right."""
    graph = import_graph()
    assert ("meshplan.inspect.methods", "meshplan.plans.plan") in graph.edges  # under TYPE_CHECKING
    assert ("meshplan.plans.plan", "meshplan.plans.check") in graph.edges  # inside Plan.from_json
    assert not any(b.startswith("meshplan.inspect") for a, b in graph.edges if a.startswith("meshplan.plans"))


LAYERS = (
    ("meshplan.progress", "meshplan.models"),
    ("meshplan.ir",),
    ("meshplan.cost_model",),
    ("meshplan.plans",),
    ("meshplan.planner", "meshplan.runtime"),  # the runtime reads plans, never the planner
    ("meshplan.regions",),  # region op plugins: each has a rule, a cost and a per-rank module; the registry is in ir
    ("meshplan.inspect", "meshplan.api"),
    ("meshplan.elastic",),  # on the public API: plans per world size, resharded resume, background checkpoints
    ("meshplan",),
    ("meshplan.profiling",),
    ("meshplan.cli", "meshplan.calibrate"),  # calibrate: the deprecated name of profiling.calibrate
    ("meshplan.__main__",),
)
"""Packages from the bottom up: each imports only packages of the layers below it (README, Layout)."""


def test_packages_import_only_the_layers_below():
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    graph = import_graph()
    assert set(map(_package, graph)) == set(layer), "a package is missing from LAYERS"
    upward = sorted({(a, b) for a, b in graph.edges if layer[_package(a)] <= layer[_package(b)] and _package(a) != _package(b)})
    assert not upward, f"imports that do not point down the layers: {upward}"


def test_import_meshplan_is_light_and_every_name_still_works():
    """`import meshplan` imports no torch (the command line's --help starts at once); each public name loads on first
    use, a Plan has its reading methods however its module was imported, and the built-in region ops are registered
    once the planner or the runtime is imported, whichever comes first (meshplan.regions itself imports the runtime)."""
    code = """
import sys
import meshplan
assert "torch" not in sys.modules, "import meshplan imported torch"
from meshplan.plans.plan import Plan
assert callable(Plan.summary) and Plan.__str__ is Plan.summary
assert "meshplan.planner" not in sys.modules and "meshplan.runtime" not in sys.modules
from meshplan.ir.regions import region_op
assert region_op("aten._log_softmax.default") is None  # nothing registered while only the plan data is loaded
import {first}
assert region_op("aten._log_softmax.default").name == "log_softmax"
for name in meshplan.__all__:
    assert getattr(meshplan, name) is not None, name
try:
    meshplan.no_such_name
except AttributeError as e:
    assert "no attribute 'no_such_name'" in str(e)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    for first in ("meshplan.planner.strategies", "meshplan.runtime.collectives", "meshplan.regions.moe"):
        res = subprocess.run([sys.executable, "-c", code.format(first=first)], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{first}: {res.stderr[-3000:]}"


def test_the_old_calibrate_module_still_works_and_warns():
    """`meshplan.calibrate` (documented before the profilers moved to meshplan/profiling) is a deprecated alias."""
    sys.modules.pop("meshplan.calibrate", None)
    with pytest.warns(DeprecationWarning, match="meshplan.profiling.calibrate"):
        old = importlib.import_module("meshplan.calibrate")
    from meshplan.profiling import calibrate

    assert old.profile_model is calibrate.profile_model and old.profile_comm is calibrate.profile_comm
