"""`Plan.report("plan.html")`: one self-contained HTML file (inline CSS, SVG and JS; nothing fetched).

Sections: the plan's step, peak and MFU as every reading prints them (figures.py), with the solver's proof and any
mesh axis that splits nothing (axes.py); the predicted step, split as `step_parts` splits it (compute /
communication / optimizer step / host / bubble, or a pipeline's working time and bubble); the layer list coloured
by placement (one coloured segment per mesh axis of more than one device, named by use: grey R, orange P, one hue
per sharded tensor dim),
memory per device as stacked bars (per pipeline stage for a pipelined plan), the pipeline schedule
(stages, ranks, microbatches, bubble, and the schedule drawn as a timeline, one row per pipeline rank,
from the model that prices it: `PipelinePlan.timeline()`; or a note that the plan runs as one stage),
and the communication volume per mesh axis. Everything is read from the
Plan alone, so `meshplan report plan.json` needs no model.
"""

from __future__ import annotations

import html
import json
import math

from meshplan.cost_model.memory import format_bytes
from meshplan.cost_model.timeline import KINDS, Block, Timeline
from meshplan.inspect.figures import figures, headline, solver_words, step_parts
from meshplan.inspect.summary import comm_volume, format_seconds, grouped_units, layer_of
from meshplan.ir.placement import Partial, Placements, Shard
from meshplan.plans.axes import AxisView, axis_view, devices_split, wasted
from meshplan.plans.plan import Plan

SHARD_COLOURS = ("#2f6fdf", "#2a9d5c", "#8e44ad", "#16a3a3", "#c0392b", "#7f8c2d")
"""Hue of Shard(0), Shard(1), ... (cycled for higher dims)."""
REPLICATE_COLOUR = "#b9bec7"
PARTIAL_COLOUR = "#e67e22"
MEMORY_COLOURS = {"params": "#2f6fdf", "grads": "#2a9d5c", "optimizer": "#8e44ad", "activations": "#e67e22"}
PHASE_COLOURS = {"forward": "#2f6fdf", "backward": "#8e44ad", "grad_sync": "#2a9d5c"}
STEP_COLOURS = {"compute": "#2f6fdf", "communication": "#e67e22", "optimizer step": "#2a9d5c", "host": "#7f8c2d",
                "working": "#2f6fdf", "bubble": "#c0392b"}
"""Segments of the step bar (figures.step_parts)."""
MAX_DEVICE_BARS = 64
"""Devices drawn one bar each; larger meshes draw one bar per distinct memory figure."""
TIMELINE_COLOURS = {"forward": "#2f6fdf", "backward": "#8e44ad", "weight": "#2a9d5c", "send": "#e67e22", "bubble": "#f2c4be"}
MAX_TIMELINE_BLOCKS = 5000
"""Timelines with more blocks are drawn at pixel resolution (each pixel the kind filling most of it), without
microbatch numbers: a block would be narrower than a pixel."""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2430;background:#fafbfc}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #dde1e6;padding-bottom:4px}
.muted{color:#5b6472}.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:12px 16px;margin:8px 0}
table{border-collapse:collapse;width:100%;background:#fff}td,th{border-bottom:1px solid #eef0f3;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f2f4f7;font-weight:600}.chip{display:inline-flex;border-radius:3px;overflow:hidden;margin:1px 4px 1px 0;vertical-align:middle}
.seg{display:inline-block;padding:0 5px;color:#fff;font:12px/18px ui-monospace,monospace}.name{font-family:ui-monospace,monospace;font-size:12px}
.legend span{margin-right:14px}.layer-row.hidden{display:none}input[type=search]{padding:4px 8px;width:280px;margin:4px 0}
svg text{font:12px system-ui,sans-serif;fill:#1d2430}
"""

_JS = """
(function(){
  var box = document.getElementById('layer-filter');
  var rows = Array.prototype.slice.call(document.querySelectorAll('.layer-row'));
  box.addEventListener('input', function(){
    var q = box.value.toLowerCase();
    rows.forEach(function(r){ r.classList.toggle('hidden', q !== '' && r.textContent.toLowerCase().indexOf(q) < 0); });
    document.getElementById('layer-count').textContent = rows.filter(function(r){ return !r.classList.contains('hidden'); }).length;
  });
  document.getElementById('layer-count').textContent = rows.length;
  document.body.setAttribute('data-rendered', 'ok');
})();
"""


def _placement_colour(p) -> str:
    if isinstance(p, Shard):
        return SHARD_COLOURS[p.dim % len(SHARD_COLOURS)]
    if isinstance(p, Partial):
        return PARTIAL_COLOUR
    return REPLICATE_COLOUR


def chip(layout: Placements, view: AxisView) -> str:
    """One coloured segment per shown mesh axis (axes of one device are hidden, as everywhere)."""
    segs = "".join(
        f'<span class="seg" style="background:{_placement_colour(layout[a])}" title="{html.escape(view.names[a])}: {layout[a]}">'
        f"{html.escape(str(layout[a]))}</span>"
        for a in view.shown
    )
    return f'<span class="chip" title="{html.escape(view.layout(layout))}">{segs}</span>'


def _bar_svg(rows: list[tuple[str, list[tuple[str, float, str]]]], unit) -> str:
    """Horizontal stacked bars: rows of (label, [(part, value, colour)]); `unit` formats a value."""
    top = max((sum(v for _, v, _ in parts) for _, parts in rows), default=0.0) or 1.0
    width, label_w, h = 900, 170, 22
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(rows) * (h + 6) + 6}" role="img">']
    for i, (label, parts) in enumerate(rows):
        y = 6 + i * (h + 6)
        out.append(f'<text x="0" y="{y + 15}">{html.escape(label)}</text>')
        x = float(label_w)
        for part, value, colour in parts:
            w = (width - label_w - 110) * value / top
            if w > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h}" fill="{colour}"><title>{html.escape(part)}: '
                    f"{html.escape(unit(value))}</title></rect>"
                )
            x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 15}">{html.escape(unit(sum(v for _, v, _ in parts)))}</text>')
    out.append("</svg>")
    return "".join(out)


def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><svg width="12" height="12"><rect width="12" height="12" fill="{c}"/></svg> {html.escape(t)}</span>' for t, c in items
    ) + "</div>"


def render(plan: Plan) -> str:
    mesh = plan.mesh
    view = axis_view(plan)
    e = html.escape
    where = f"mesh {view.mesh} ({plan.devices} devices)" if plan.pipeline is None else devices_split(plan, view)
    renamed = "" if view.names == mesh.axis_names else f" (axes named by use; stored as {', '.join(mesh.axis_names)})"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>meshplan plan {e(plan.model)} on {e(where)}</title><style>{_CSS}</style></head><body>",
        f"<h1>meshplan plan for {e(plan.model)}</h1>",
        f'<div class="muted">{e(where)}{e(renamed)}, cluster {e(plan.cluster)}, mode {e(plan.mode)}, '
        f"inputs {e(plan.inputs_mode)}, plan hash {plan.hash()}</div>",
        f'<div class="card" id="figures">Predicted: {e(headline(plan))}<br><span class="muted">solver: {e(solver_words(plan.solver))}'
        "</span></div>",
    ]
    parts += [f'<div class="card wasted">Wasted: {e(line)}</div>' for line in wasted(plan, view)]
    # ---- step time
    parts.append("<h2>Predicted step time</h2>")
    pipe = plan.pipeline
    if pipe is not None:  # compute_s and comm_s are one microbatch's on one stage's sub-mesh; the schedule's step holds them all
        parts.append(f'<div class="muted">One microbatch on one stage\'s sub-mesh: compute {plan.compute_s * 1e3:.3f} ms, '
                     f"communication {plan.comm_s * 1e3:.3f} ms; the step runs {pipe.microbatches} microbatches through "
                     f"{pipe.degree} pipeline ranks.</div>")
    step = [(name, v, STEP_COLOURS[name]) for name, v in step_parts(plan)]
    parts.append(_bar_svg([("one step", step)], lambda v: f"{v * 1e3:.3f} ms"))
    parts.append(_legend([(f"{name} {v * 1e3:.3f} ms", c) for name, v, c in step]))
    # ---- layers
    parts.append("<h2>Layers, coloured by placement</h2>")
    parts.append(
        '<div class="muted">Each chip has one segment per mesh axis (' + e(", ".join(view.names[a] for a in view.shown))
        + "; axes of one device are left out). Identical repeated layers are shown once.</div>"
    )
    parts.append(_legend([("R replicate", REPLICATE_COLOUR), ("P partial sum", PARTIAL_COLOUR)]
                         + [(f"S({d}) shard tensor dim {d}", c) for d, c in enumerate(SHARD_COLOURS[:4])]))
    parts.append('<input type="search" id="layer-filter" placeholder="filter layers, e.g. mlp or S(1)"> '
                 '<span class="muted"><span id="layer-count"></span> layers shown</span>')
    op_rows = _op_rows(plan, view)
    parts.append("<table><tr><th>layer</th><th>parameters</th><th>ops and their output layout</th><th>compute</th></tr>")
    for label, count, unit in grouped_units(plan):
        params = "<br>".join(
            f'{chip(p.layout, view)}<span class="name">{e(" = ".join(p.fqns))}</span>'
            for p in plan.params if layer_of(p.fqns[0]) == unit.name
        ) or "-"
        ops = "<br>".join(op_rows.get(unit.name, [])) or "-"
        name = e(label) + (f" <span class='muted'>(x{count})</span>" if count > 1 else "")
        ms = format_seconds(unit.compute_s) + (" each" if count > 1 else "")
        parts.append(f'<tr class="layer-row"><td class="name">{name}</td><td>{params}</td><td>{ops}</td><td>{ms}</td></tr>')
    parts.append("</table>")
    # ---- memory
    parts.append("<h2>Memory per device</h2>")
    mem = plan.peak_memory
    segs = [(k, float(getattr(mem, k)), c) for k, c in MEMORY_COLOURS.items()]
    if pipe is not None:
        rows = [(f"stage {st.index} (pipeline rank {st.device})", [(k, float(getattr(st.memory, k)), c) for k, c in MEMORY_COLOURS.items()])
                for st in pipe.stages]
        note = (f"Each device of a stage's {mesh.size}-device sub-mesh holds the stage's amount (shards are even); the "
                "fullest pipeline rank (the sum of the stages it runs) sets the peak.")
    elif mesh.size <= MAX_DEVICE_BARS:
        rows = [(f"device {r}", segs) for r in range(mesh.size)]
        note = "Every device holds the same amount under this plan (one stage; shards are even)."
    else:
        rows = [(f"devices 0..{mesh.size - 1}", segs)]
        note = f"All {mesh.size} devices hold the same amount under this plan (one stage; shards are even): one bar shown."
    parts.append(f'<div class="muted">{e(note)} Peak {e(format_bytes(mem.total))} per device.</div>')
    parts.append(_bar_svg(rows, format_bytes))
    parts.append(_legend([(f"{k} {format_bytes(getattr(mem, k))}", c) for k, c in MEMORY_COLOURS.items()]))
    # ---- pipeline
    parts.append("<h2>Pipeline schedule</h2>")
    if pipe is None:
        parts.append(
            f'<div class="card" id="pipeline">No pipeline stages: this plan runs as a single stage on all {mesh.size} devices, so '
            "there is no pipeline schedule and the bubble is 0.</div>"
        )
    else:
        parts.append(
            f'<div class="card" id="pipeline">{pipe.degree} pipeline ranks x {mesh.size} devices each, schedule {e(pipe.schedule)}, '
            f"{pipe.microbatches} microbatches, {pipe.chunks} stage(s) per rank; bubble {pipe.bubble_fraction:.1%} "
            f"({pipe.bubble_s * 1e3:.3f} ms of a {pipe.step_s * 1e3:.3f} ms step), point-to-point {pipe.p2p_s * 1e6:.3g} µs per cut "
            "per microbatch.</div>"
        )
        parts.append(_timeline_section(pipe.timeline(), pipe.step_s))
        parts.append("<table><tr><th>stage</th><th>pipeline rank</th><th>units</th><th>per microbatch</th><th>recompute</th><th>peak memory</th></tr>")
        for st in pipe.stages:
            span = st.units[0] if len(st.units) == 1 else f"{st.units[0]} .. {st.units[-1]}"
            parts.append(f"<tr><td>{st.index}</td><td>{st.device}</td><td class='name'>{e(span)} ({len(st.units)})</td>"
                         f"<td>{st.time_s * 1e3:.3f} ms</td><td>{'yes' if st.recompute else 'no'}</td>"
                         f"<td>{e(format_bytes(st.memory.total))}</td></tr>")
        parts.append("</table>")
    # ---- communication
    parts.append("<h2>Communication volume per mesh axis</h2>")
    vol = comm_volume(plan)
    if vol:
        per_axis: dict[str, list] = {}
        for v in vol:
            per_axis.setdefault(v.axes, []).append((f"{v.phase} {v.kind} x{v.count}", float(v.nbytes), PHASE_COLOURS[v.phase]))
        parts.append('<div class="muted">Bytes each device moves per training step, by the mesh axes its collectives run over.</div>')
        parts.append(_bar_svg([(f"axis {a}", segs) for a, segs in per_axis.items()], format_bytes))
        parts.append(_legend([(k.replace("_", " "), c) for k, c in PHASE_COLOURS.items()]))
        parts.append("<table><tr><th>axes</th><th>phase</th><th>collective</th><th>count</th><th>bytes</th></tr>")
        for v in vol:
            parts.append(f"<tr><td>{e(v.axes)}</td><td>{e(v.phase)}</td><td>{e(v.kind)}</td><td>{v.count}</td><td>{e(format_bytes(v.nbytes))}</td></tr>")
        parts.append("</table>")
    else:
        parts.append('<div class="card">This plan needs no communication.</div>')
    if plan.fallbacks:
        parts.append("<h2>Replicated for lack of a rule</h2><ul>" + "".join(f"<li>{e(f)}</li>" for f in plan.fallbacks) + "</ul>")
    parts.append(f"<details><summary>Plan summary (text)</summary><pre>{e(plan.summary())}</pre></details>")
    parts.append(f'<script type="application/json" id="plan-meta">{e(json.dumps({"hash": plan.hash(), **figures(plan)}))}</script>')
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts)


def _nice_step(span: float, ticks: int) -> float:
    """A 1, 2 or 5 x 10^k step giving at most `ticks` intervals over `span`."""
    raw = span / ticks if span > 0 else 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)


def _pixel_runs(blocks: tuple[Block, ...], scale: float, width: int) -> list[tuple[int, int, str]]:
    """(first pixel, end pixel, kind) runs: each pixel takes the kind that fills most of it."""
    fill: list[dict[str, float]] = [{} for _ in range(width)]
    for b in blocks:
        x0, x1 = b.start * scale, b.end * scale
        for col in range(max(0, int(x0)), min(width, math.ceil(x1))):
            share = min(x1, col + 1) - max(x0, col)
            if share > 0:
                fill[col][b.kind] = fill[col].get(b.kind, 0.0) + share
    runs: list[tuple[int, int, str]] = []
    for col, f in enumerate(fill):
        kind = max(f, key=f.get) if f else None
        if kind is None:
            continue
        if runs and runs[-1][2] == kind and runs[-1][1] == col:
            runs[-1] = (runs[-1][0], col + 1, kind)
        else:
            runs.append((col, col + 1, kind))
    return runs


def _timeline_svg(tl: Timeline) -> str:
    """One row per pipeline rank: its forward, backward, weight-backward, send and bubble blocks on an axis in ms."""
    e = html.escape
    width, label_w, h, gap, axis_h = 900, 70, 24, 6, 30
    plot_w = width - label_w - 20
    span = tl.makespan_s
    scale = plot_w / span if span > 0 else 0.0
    rows_h = tl.stages * (h + gap) + gap
    count = sum(len(row) for row in tl.rows)
    dense = count > MAX_TIMELINE_BLOCKS
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" id="pipeline-timeline" width="{width}" height="{rows_h + axis_h}" role="img" '
           f'aria-label="pipeline schedule {e(tl.schedule)}: {tl.stages} ranks, {tl.microbatches} microbatches">']
    step = _nice_step(span * 1e3, 8)
    k = 0
    while span > 0 and k * step <= span * 1e3 * (1 + 1e-9):
        x = label_w + k * step / 1e3 * scale
        out.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{rows_h}" stroke="#e3e6ea"/>'
                   f'<text x="{x:.1f}" y="{rows_h + 14}" text-anchor="middle">{k * step:.4g}</text>')
        k += 1
    out.append(f'<text x="{width - 4}" y="{rows_h + 28}" text-anchor="end">ms</text>')
    for r in range(tl.stages):
        y = gap + r * (h + gap)
        out.append(f'<text x="0" y="{y + 16}">rank {r}</text><g class="timeline-rank" data-rank="{r}">')
        blocks = tl.rank(r)
        if dense:
            runs: dict[str, list[str]] = {}
            for x0, x1, kind in _pixel_runs(blocks, scale, plot_w):
                runs.setdefault(kind, []).append(f"M{label_w + x0} {y}h{x1 - x0}v{h}h{x0 - x1}z")
            out += [f'<path d="{"".join(d)}" fill="{TIMELINE_COLOURS[kind]}" data-kind="{kind}"/>' for kind, d in runs.items()]
        for b in blocks if not dense else ():
            x, w = label_w + b.start * scale, (b.end - b.start) * scale
            what = "idle" if b.kind == "bubble" else f"{b.kind} of microbatch {b.microbatch}, stage {b.stage} (chunk {b.chunk})"
            faded = f' fill-opacity="{1 - 0.45 * b.chunk / (tl.chunks - 1):.2f}"' if b.chunk and tl.chunks > 1 else ""
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{TIMELINE_COLOURS[b.kind]}"{faded} '
                       f'data-kind="{b.kind}"><title>rank {r}: {e(what)}, {b.start * 1e3:.4g}-{b.end * 1e3:.4g} ms</title></rect>')
            label = str(b.microbatch)
            if b.kind in ("forward", "backward", "weight") and w >= 6 * len(label) + 3:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + 16}" text-anchor="middle" style="fill:#fff;font-size:11px">{label}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _per_microbatch(tl: Timeline) -> str:
    """What each rank of the timeline spends per microbatch, in words."""
    slowest = (tl.t_f + tl.t_b + tl.t_w) * 1e3
    if not tl.shares:
        return f"every rank runs the slowest rank's {slowest:.3f} ms per microbatch"
    each = [slowest * x for x in tl.shares]
    spread = " / ".join(f"{x:.3f}" for x in each) if len(each) <= 8 else f"{min(each):.3f} to {max(each):.3f}"
    return f"ranks run {spread} ms per microbatch (their stages' own)"


def _timeline_section(tl: Timeline, step_s: float) -> str:
    e = html.escape
    outside = step_s - tl.makespan_s
    rest = (f"; the plan's step of {step_s * 1e3:.3f} ms adds {outside * 1e3:.3f} ms after it (gradient all-reduces)"
            if outside > 1e-9 * step_s else "")
    present = {b.kind for row in tl.rows for b in row}
    kinds = [k for k in KINDS if k in present]
    names = {"forward": "forward", "backward": "backward" if "weight" not in kinds else "backward for inputs",
             "weight": "backward for weights", "send": "send to the neighbouring rank", "bubble": "bubble (idle)"}
    count = sum(len(row) for row in tl.rows)
    dense = count > MAX_TIMELINE_BLOCKS
    chunks = f" Each rank runs {tl.chunks} model chunks" + ("." if dense else "; later chunks are drawn lighter.") if tl.chunks > 1 else ""
    note = (f" {count} blocks: drawn at pixel resolution, without microbatch numbers." if dense else " Numbers are microbatches.")
    return (
        f'<div class="muted" id="pipeline-timeline-caption">Timeline of one step under {e(tl.schedule)}, from the model that prices it: '
        f"{_per_microbatch(tl)}; schedule {tl.makespan_s * 1e3:.3f} ms, {'the busiest' if tl.shares else 'each'} rank idle "
        f"{tl.bubble_s * 1e3:.3f} ms: bubble {tl.bubble_fraction:.1%}{e(rest)}."
        f"{chunks}{note}</div>"
        + _timeline_svg(tl)
        + _legend([(names[k], TIMELINE_COLOURS[k]) for k in kinds])
    )


def _op_rows(plan: Plan, view: AxisView) -> dict[str, list[str]]:
    """Per layer unit: the significant ops with a chip of their first output layout."""
    top = max((n.time_s for n in plan.nodes), default=0.0)
    out: dict[str, list[str]] = {}
    for n in plan.nodes:
        layout = n.strategy.outputs[0] if n.strategy.outputs else None
        if layout is None or top == 0 or n.time_s < 0.01 * top:
            continue
        op = n.target.removeprefix("aten.").split(".")[0]
        out.setdefault(layer_of(n.module_path), []).append(
            f'{chip(layout, view)}<span class="name">{html.escape(n.module_path or "-")} {html.escape(op)}</span>'
        )
    return out


def write_report(plan: Plan, path: str) -> str:
    """Write `render(plan)` to `path`; returns `path`."""
    text = render(plan)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise ValueError(f"cannot write the report to {path!r}: {err.strerror}") from None
    return path
