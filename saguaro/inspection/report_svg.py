"""Small inline-SVG figures for the HTML report: bar charts, a line chart and a lane timeline."""

from __future__ import annotations

from html import escape

from saguaro.runtime.base.trace_read import Slice

PALETTE = {
    "target": "#2e86c1",
    "draft": "#28b463",
    "host": "#909497",
    "wait": "#e67e22",
    "transport": "#8e44ad",
    "fallback": "#c0392b",
}


def _frame(width: int, height: int, title: str, body: list[str], cls: str) -> str:
    return (
        f'<svg class="chart {cls}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
        f'<text x="{width / 2}" y="16" text-anchor="middle" class="title">{escape(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def bar_chart(
    labels: list[str],
    values: list[float],
    title: str,
    ymax: float | None = None,
    fmt: str = "{:.2f}",
    cls: str = "bars",
    color: str = "#2e86c1",
) -> str:
    """Vertical bars, one per label, each with its value above it."""
    width, height, left, bottom, top = max(320, 60 * len(labels) + 60), 240, 40, 30, 30
    ymax = ymax if ymax is not None else max(values + [1e-9])
    plot_h = height - bottom - top
    step = (width - left - 10) / max(len(values), 1)
    body = [
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 10}" y2="{height - bottom}" stroke="#555"/>'
    ]
    for i, (label, value) in enumerate(zip(labels, values)):
        h = plot_h * (value / ymax if ymax else 0.0)
        x = left + i * step + step * 0.15
        body.append(
            f'<rect class="bar" x="{x:.1f}" y="{height - bottom - h:.1f}" width="{step * 0.7:.1f}" '
            f'height="{h:.1f}" fill="{color}"><title>{escape(label)}: {fmt.format(value)}</title></rect>'
        )
        body.append(
            f'<text x="{x + step * 0.35:.1f}" y="{height - bottom - h - 4:.1f}" text-anchor="middle" '
            f'class="value">{fmt.format(value)}</text>'
        )
        body.append(
            f'<text x="{x + step * 0.35:.1f}" y="{height - bottom + 16}" text-anchor="middle">'
            f"{escape(label)}</text>"
        )
    return _frame(width, height, title, body, cls)


def line_chart(xs: list[float], ys: list[float], title: str, ymax: float = 1.0, cls: str = "line") -> str:
    """A polyline of ``ys`` over ``xs`` (``ys`` in ``[0, ymax]``)."""
    width, height, left, bottom, top = 480, 240, 40, 30, 30
    if not xs:
        return _frame(width, height, title + " (no data)", [], cls)
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    sx = lambda x: left + (width - left - 10) * (x - x0) / (x1 - x0)
    sy = lambda y: height - bottom - (height - bottom - top) * (y / ymax)
    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    body = [
        f'<line x1="{left}" y1="{sy(0)}" x2="{width - 10}" y2="{sy(0)}" stroke="#555"/>',
        f'<line x1="{left}" y1="{sy(0)}" x2="{left}" y2="{sy(ymax)}" stroke="#555"/>',
        f'<text x="{left - 4}" y="{sy(ymax) + 4}" text-anchor="end">{ymax:g}</text>',
        f'<text x="{left - 4}" y="{sy(0) + 4}" text-anchor="end">0</text>',
        f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle">round</text>',
        f'<polyline class="series" points="{points}" fill="none" stroke="#2e86c1" stroke-width="2"/>',
    ]
    return _frame(width, height, title, body, cls)


def _color(s: Slice) -> str:
    if s.name.startswith("wait"):
        return PALETTE["wait"]
    if s.name.startswith(("send", "recv")):
        return PALETTE["transport"]
    if s.name.startswith("fallback"):
        return PALETTE["fallback"]
    return PALETTE.get(s.track, "#7f8c8d")


def timeline(slices: list[Slice], start_us: float, end_us: float, title: str) -> str:
    """Lanes as rows (one per process and track), each slice a bar, nested slices drawn thinner."""
    shown = [s for s in slices if s.end_us > start_us and s.start_us < end_us and s.name != "round"]
    rounds = [s for s in slices if s.name == "round" and s.end_us > start_us and s.start_us < end_us]
    rows = sorted({(s.pid, s.track) for s in shown}, key=lambda r: (r[1] != "host", r[1] != "target", r))
    width, left, row_h, top = 980, 150, 46, 30
    height = top + row_h * len(rows) + 30
    scale = (width - left - 10) / max(end_us - start_us, 1e-9)
    x = lambda t: left + (max(start_us, min(end_us, t)) - start_us) * scale
    body = []
    for r in rounds:
        body.append(
            f'<line x1="{x(r.start_us):.1f}" y1="{top}" x2="{x(r.start_us):.1f}" y2="{height - 24}" '
            f'stroke="#bbb" stroke-dasharray="3,3"/><text x="{x(r.start_us) + 2:.1f}" y="{height - 12}" '
            f'class="small">round {r.args.get("round", "")}</text>'
        )
    for i, (pid, track) in enumerate(rows):
        y = top + i * row_h
        body.append(f'<text x="4" y="{y + row_h / 2 + 4}">{escape(track)} (pid {pid})</text>')
        lane = sorted(
            (s for s in shown if (s.pid, s.track) == (pid, track)), key=lambda s: (s.start_us, -s.end_us)
        )
        open_ends: list[float] = []
        for s in lane:
            while open_ends and open_ends[-1] <= s.start_us:
                open_ends.pop()
            depth = len(open_ends)
            open_ends.append(s.end_us)
            inset = min(depth, 3) * 7
            w = max(x(s.end_us) - x(s.start_us), 0.8)
            body.append(
                f'<rect class="slice" x="{x(s.start_us):.1f}" y="{y + 4 + inset}" width="{w:.1f}" '
                f'height="{row_h - 8 - 2 * inset}" fill="{_color(s)}" opacity="{0.55 + 0.15 * min(depth, 3)}">'
                f"<title>{escape(s.name)}: {s.dur_us / 1000:.3f} ms</title></rect>"
            )
    legend = " ".join(f'<tspan fill="{c}">■</tspan> {k}' for k, c in PALETTE.items())
    body.append(f'<text x="{left}" y="{top - 8}" class="small">{legend}</text>')
    return _frame(width, height, title, body, "timeline")
