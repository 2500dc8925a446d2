"""The plan data layer: what the planner decided and the runtime reads (`Plan` and its parts, the
pipeline section, strategies, recorded alternatives), its JSON and its checks, and what each mesh
axis of a plan carries (axes.py: the names every reading prints, and the axes that split nothing,
which `meshplan.plan` warns of). Data only: it imports the IR and the cost model's value types,
nothing that plans, runs or presents.

Named `plans` because `meshplan.plan` is the planning function."""
