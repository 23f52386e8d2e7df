"""``saguaro report OUT.html``: one self-contained page (inline SVG and script, no network) about an SSD
generation: the round schedule, a timeline of a few rounds, acceptance and cache hits by position,
hit rate over the generation, the fan-out per position, the stats table and the stage graphs."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

import torch

from saguaro.core.stages import stages_for
from saguaro.inspection.graph_view import have_dot
from saguaro.inspection.inspector import Inspector
from saguaro.inspection.report_svg import bar_chart, line_chart, timeline
from saguaro.runtime.base.stats import run_label
from saguaro.runtime.base.trace_read import counters, slices

TIMELINE_ROUNDS = 4
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main():\n"
STYLE = """body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}
svg text{font-size:12px;font-family:Helvetica,Arial,sans-serif}svg .title{font-weight:bold}
svg .small{font-size:10px}.figs{display:flex;flex-wrap:wrap;gap:16px}pre{background:#f6f6f6;padding:8px;
overflow:auto;font-size:12px;max-height:240px}#schedule svg,details svg{max-width:100%;height:auto}rect.slice:hover,rect.bar:hover{stroke:#000;stroke-width:1}"""
SCRIPT = """document.querySelectorAll('details.graph').forEach(function(d){
  if (location.hash === '#' + d.id) d.open = true;});
window.addEventListener('hashchange', function(){var d=document.getElementById(location.hash.slice(1));
  if (d && d.tagName === 'DETAILS') d.open = true;});
document.getElementById('charts-count').textContent = document.querySelectorAll('svg.chart').length;
document.body.setAttribute('data-rendered', 'yes');"""


def write_report(
    program,
    out,
    tokenizer=None,
    prompt: str = DEFAULT_PROMPT,
    input_ids=None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
) -> Path:
    """Generate once with SSD (traced) and write the report page to ``out``; returns its path."""
    if input_ids is None:
        if tokenizer is None:
            raise ValueError("write_report needs input_ids or a tokenizer to encode the prompt")
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"write_report takes one prompt: input_ids of shape [1, T], got {tuple(input_ids.shape)}"
        )
    input_ids = input_ids.to(program.target.spec.device)
    inspector = Inspector(program)
    inspector.measure("ssd", input_ids=input_ids)  # a warm-up: every stage built, the lane started
    result = program.generate(
        input_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        mode="ssd",
        seed=0,
        eos_token_id=None,
        trace=True,
    )
    inspector.costs.clear()
    inspector.observe(result.trace)  # the schedule costed with this generation's own stage times
    completion = None
    if tokenizer is not None:
        completion = tokenizer.decode(result.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    page = render(inspector, result.stats, result.trace, temperature, completion)
    path = Path(out)
    path.write_text(page)
    return path


def _figures(stats: dict, trace: dict, k: int) -> list[str]:
    lengths = [int(round(v["mean"])) for _, v in counters(trace, "accepted length")]  # one row: exact
    looked_up = lengths[:-1] if len(lengths) > 1 else lengths  # the last round matches nothing
    outcome_counts = [sum(1 for n in looked_up if n - 1 == a) for a in range(k + 1)]
    per_position = [sum(1 for n in lengths if n - 1 >= j) / max(len(lengths), 1) for j in range(1, k + 1)]
    hits = stats.get("hits_by_position", {})
    hit_rate = [hits.get(a, 0) / c if c else 0.0 for a, c in enumerate(outcome_counts)]
    cache = counters(trace, "cache")
    cumulative, seen, hit = [], 0, 0
    for _, v in cache:
        seen, hit = seen + v["hits"] + v["misses"], hit + v["hits"]
        cumulative.append(hit / seen if seen else 0.0)
    fan = [v for _, v in counters(trace, "fan-out")]
    mean_fan = [sum(v.get(f"F{j}", 0) for v in fan) / max(len(fan), 1) for j in range(k + 1)]
    return [
        bar_chart(
            [f"x{j}" for j in range(1, k + 1)],
            per_position,
            "Acceptance by draft position",
            ymax=1.0,
            cls="acceptance",
        ),
        bar_chart(
            [str(a) for a in range(k + 1)],
            hit_rate,
            "Cache hit rate by outcome position a",
            ymax=1.0,
            cls="hits",
            color="#28b463",
        ),
        line_chart(
            list(range(1, len(cumulative) + 1)),
            cumulative,
            "Cache hit rate over the generation",
            cls="hits-over-time",
        ),
        bar_chart(
            [f"F{j}" for j in range(k + 1)],
            mean_fan,
            "Fan-out per position (mean over rounds)",
            fmt="{:.1f}",
            cls="fan-out",
            color="#8e44ad",
        ),
    ]


def _timeline(trace: dict) -> str:
    all_slices = slices(trace)
    rounds = sorted(
        (s for s in all_slices if s.track == "host" and s.name == "round"), key=lambda s: s.start_us
    )
    if not rounds:
        return "<p>no rounds recorded</p>"
    shown = rounds[1 : 1 + TIMELINE_ROUNDS] or rounds[:TIMELINE_ROUNDS]
    return timeline(
        all_slices,
        shown[0].start_us,
        shown[-1].end_us,
        f"Timeline of rounds {shown[0].args.get('round')}–{shown[-1].args.get('round')}",
    )


def _stats_table(stats: dict) -> str:
    rows = []
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        rows.append(f"<tr><th>{escape(str(key))}</th><td>{escape(str(value))}</td></tr>")
    return f'<table id="stats">{"".join(rows)}</table>'


def _graphs(inspector: Inspector, temperature: float) -> tuple[str, str]:
    links, blocks = [], []
    for stage in stages_for("ssd", temperature):
        anchor = "graph-" + stage.qualified.replace(".", "-")
        links.append(f'<li><a href="#{anchor}">{escape(stage.qualified)}</a></li>')
        body = (
            inspector.graph(stage, format="svg")
            if have_dot()
            else f"<pre>{escape(inspector.graph(stage, format='text'))}</pre>"
        )
        body = body[body.find("<svg") :] if body.lstrip().startswith("<?xml") else body
        table = escape(inspector.passes(stage))
        blocks.append(
            f'<details class="graph" id="{anchor}"><summary>{escape(stage.qualified)}</summary>'
            f"<pre>{table}</pre>{body}</details>"
        )
    return f'<ul id="graph-links">{"".join(links)}</ul>', "".join(blocks)


def render(inspector: Inspector, stats: dict, trace: dict, temperature: float, completion: str | None) -> str:
    program = inspector.program
    cfg = program.config
    if have_dot():
        schedule = inspector.schedule("ssd", format="svg")
        schedule = schedule[schedule.find("<svg") :]
    else:
        schedule = f"<pre>{escape(inspector.schedule('ssd', format='dot'))}</pre>"
    links, graphs = _graphs(inspector, temperature)
    figures = "".join(f"<div>{f}</div>" for f in _figures(stats, trace, cfg.k))
    text = f"<h2>Completion</h2><pre>{escape(completion)}</pre>" if completion is not None else ""
    title = escape(run_label(stats))  # "ssd (ran as SD: no tree pays here)" where the planner ran SD
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Saguaro report</title><style>{STYLE}</style></head>
<body><h1>Saguaro report: {title}, k={cfg.k}, backend {escape(cfg.backend)}, lane {escape(program.lane_kind)}</h1>
<p>{stats["new_tokens"]} tokens at {stats["tokens_per_s"]:.1f} tokens/s, mean accepted length
{stats["mean_accepted_len"]:.2f}, cache hit rate {stats.get("cache_hit_rate", 0):.2f};
<span id="charts-count">?</span> charts. Torch {escape(torch.__version__)}.</p>{text}
<h2>Round schedule</h2><div id="schedule">{schedule}</div>
<h2>Timeline</h2><div id="timeline">{_timeline(trace)}</div>
<h2>Acceptance, cache hits, fan-out</h2><div class="figs">{figures}</div>
<h2>Stats</h2>{_stats_table(stats)}
<h2>Stage graphs</h2>{links}{graphs}
<script>{SCRIPT}</script></body></html>
"""
