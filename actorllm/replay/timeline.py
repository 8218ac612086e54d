"""The timeline: one row per request, coloured by state over time, with marks.

Marks: a red cross where a request was aborted, an orange triangle where it was
preempted, a black diamond where a late result for it was dropped, white ticks where the
Scheduler committed a token, and a red outline where its history broke the spec.

One drawing (a list of shapes in pixel coordinates) is built once and then written as a
self-contained HTML page (inline SVG, tooltips through ``<title>``, no JavaScript) or as
a PNG through Pillow. Pillow is optional: asking for a PNG without it is a clear error.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path

import attrs

from actorllm.lifecycle.invariants import fold
from actorllm.lifecycle.table import Spec, State
from actorllm.replay.check import Violation
from actorllm.replay.summary import Summary
from actorllm.replay.tracefile import Trace

# One colour per state of the table, keyed on its enum (load_spec checks the enum against
# the table); tests/test_replay.py fails on a state without one.
STATE_COLOURS: dict[State, str] = {
    State.CREATED: "#cbd5e1",
    State.TOKENIZING: "#a5b4fc",
    State.WAITING: "#fcd34d",
    State.RUNNING: "#22c55e",
    State.PREEMPTED: "#f97316",
    State.PAUSED: "#14b8a6",
    State.FINISHED: "#3b82f6",
    State.FREED: "#93c5fd",
    State.RESPONDED: "#c4b5fd",
    State.RELEASED: "#e5e7eb",
    State.GATHERING: "#e9d5ff",
}
MARK_COLOURS = {"abort": "#dc2626", "preempt": "#c2410c", "late": "#111827", "token": "#ffffff"}

LABEL_W, PLOT_W, ROW_H, ROW_GAP, TOP, BOTTOM, MARGIN = 170, 900, 16, 4, 64, 40, 10


class TimelineError(Exception):
    """The timeline cannot be written (unknown format, Pillow missing, I/O error)."""


@attrs.frozen
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    title: str = ""
    stroke: str | None = None


@attrs.frozen
class Seg:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str
    width: float = 1.0


@attrs.frozen
class Text:
    x: float
    y: float
    text: str
    size: int = 11
    fill: str = "#111827"
    anchor: str = "start"  # start | middle | end


@attrs.frozen
class Mark:
    x: float
    y: float  # the centre
    shape: str  # cross | triangle | diamond
    fill: str
    title: str = ""


Shape = Rect | Seg | Text | Mark


@attrs.define
class Row:
    """One request's row: its shapes, kept together so the SVG can group them."""

    rid: str
    shapes: list[Shape] = attrs.Factory(list)


@attrs.define
class Drawing:
    width: int
    height: int
    title: str
    background: list[Shape] = attrs.Factory(list)  # axis, legend, grid
    rows: list[Row] = attrs.Factory(list)


def build_timeline(trace: Trace, spec: Spec, summary: Summary,
                   violations: list[Violation]) -> Drawing:
    """Lay out the drawing: rows in the order requests were registered, children under
    their parent, the time axis shared by every session of the file."""
    by_name = {incarnation.name: incarnation for incarnation in trace.incarnations}
    parent_of = {r.rid: r.parent for r in summary.requests if r.parent}
    order = [r.rid for r in summary.requests]  # each parent followed by its children
    times = [ln.t for s in trace.sessions for ln in s.lines]
    t0 = min([s.t0 for s in trace.sessions if s.t0 is not None] + times)
    t1 = max(times) if times else t0 + 1.0
    span = max(t1 - t0, 1e-6)
    height = TOP + len(order) * (ROW_H + ROW_GAP) + BOTTOM
    drawing = Drawing(LABEL_W + PLOT_W + 2 * MARGIN, height,
                      f"{os.path.basename(trace.path)}: {len(order)} requests, "
                      f"{span * 1e3:.1f} ms")

    def x_of(t: float) -> float:
        return LABEL_W + MARGIN + (t - t0) / span * PLOT_W

    _legend(drawing)
    _axis(drawing, span, height, x_of, t0)
    bad = {v.rid: v for v in violations}
    marks = _record_marks(trace, spec)
    for i, name in enumerate(order):
        incarnation = by_name[name]
        y = TOP + i * (ROW_H + ROW_GAP)
        row = Row(name)
        child = name in parent_of  # children sit indented under their parent
        row.shapes.append(Text(MARGIN + (14 if child else 0), y + ROW_H - 4, _short(name), 11,
                               fill="#4b5563" if child else "#111827"))
        state: str | None = None
        lines = incarnation.lines
        # fold() stops at an illegal event: from there on the red outline says so.
        for j, after in enumerate(fold(spec, incarnation.events)):
            line = lines[j]
            before, state = state, after
            if state is None:
                break
            if state in spec.final_states:
                if before not in spec.final_states:  # the end of the request: a bar
                    row.shapes.append(Seg(x_of(line.t), y, x_of(line.t), y + ROW_H, "#374151",
                                          1.5))
                continue
            end = lines[j + 1].t if j + 1 < len(lines) else t1
            row.shapes.append(Rect(
                x_of(line.t), y, max(x_of(end) - x_of(line.t), 0.5), ROW_H,
                STATE_COLOURS[State(state)],
                f"{name}: {state} from {(line.t - t0) * 1e3:.2f} ms for "
                f"{(end - line.t) * 1e3:.2f} ms (after {line.event}, line {line.no})"))
            if line.event == "abort":
                row.shapes.append(Mark(x_of(line.t), y + ROW_H / 2, "cross",
                                       MARK_COLOURS["abort"], f"{name}: aborted (line {line.no})"))
            elif line.event == "preempt":
                row.shapes.append(Mark(x_of(line.t), y + ROW_H / 2, "triangle",
                                       MARK_COLOURS["preempt"],
                                       f"{name}: preempted (line {line.no})"))
        for kind, t, no in marks.get(name, ()):
            if kind == "token":
                row.shapes.append(Seg(x_of(t), y + ROW_H - 5, x_of(t), y + ROW_H - 1,
                                      MARK_COLOURS["token"], 1.0))
            else:
                row.shapes.append(Mark(x_of(t), y + ROW_H / 2, "diamond", MARK_COLOURS["late"],
                                       f"{name}: late result dropped (line {no})"))
        if name in bad:
            v = bad[name]
            row.shapes.append(Rect(LABEL_W + MARGIN, y - 1, PLOT_W, ROW_H + 2, "none",
                                   f"{name}: {v.kind}: {v.message}", stroke="#dc2626"))
        drawing.rows.append(row)
    return drawing


def _record_marks(trace: Trace, spec: Spec) -> dict[str, list[tuple[str, float, int]]]:
    """Committed tokens and late drops per incarnation, from the Scheduler's result records."""
    out: dict[str, list[tuple[str, float, int]]] = {}
    for session in trace.sessions:
        terminal_at = {incarnation.name: min((ln.no for ln in incarnation.lines
                                       if ln.event in spec.terminal_events), default=None)
                       for incarnation in session.incarnations}
        for line in session.records("result"):
            for rid, _tok in line.data.get("tokens") or ():
                incarnation = session.incarnation_at(str(rid), line.no)
                if incarnation is None:
                    continue
                done = terminal_at[incarnation.name]
                kind = "late" if done is not None and done < line.no else "token"
                out.setdefault(incarnation.name, []).append((kind, line.t, line.no))
    return out


def _legend(d: Drawing) -> None:
    d.background.append(Text(MARGIN, 20, d.title, 14))
    x = MARGIN
    for state in State:  # the table's order
        d.background.append(Rect(x, 32, 10, 10, STATE_COLOURS[state]))
        d.background.append(Text(x + 13, 41, state, 10))
        x += 16 + 7 * len(state)
    for shape, colour, label in (("cross", MARK_COLOURS["abort"], "abort"),
                                 ("triangle", MARK_COLOURS["preempt"], "preempt"),
                                 ("diamond", MARK_COLOURS["late"], "late result dropped")):
        d.background.append(Mark(x + 5, 37, shape, colour))
        d.background.append(Text(x + 13, 41, label, 10))
        x += 20 + 6 * len(label)


def _axis(d: Drawing, span: float, height: int, x_of: object, t0: float) -> None:
    step = _nice_step(span / 8)
    base = height - BOTTOM + 6
    d.background.append(Seg(LABEL_W + MARGIN, base, LABEL_W + MARGIN + PLOT_W, base, "#6b7280"))
    k = 0
    while k * step <= span * 1.0001:
        x = x_of(t0 + k * step)  # type: ignore[operator]
        d.background.append(Seg(x, TOP - 4, x, base, "#f3f4f6"))
        d.background.append(Seg(x, base, x, base + 4, "#6b7280"))
        d.background.append(Text(x, base + 16, _fmt_ms(k * step), 10, anchor="middle"))
        k += 1
    d.background.append(Text(LABEL_W + MARGIN + PLOT_W, base + 30, "time since start (ms)", 10,
                             anchor="end"))


def _nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw``."""
    if raw <= 0:
        return 1.0
    p = 10 ** math.floor(math.log10(raw))
    return next(m * p for m in (1, 2, 5, 10) if m * p >= raw)


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 10 or ms == 0 else f"{ms:.2g}"


def _short(name: str, limit: int = 24) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


# --- writers ----------------------------------------------------------------------------


def write_timeline(drawing: Drawing, path: str | os.PathLike[str]) -> None:
    """Write ``drawing`` as HTML (``.html``/``.htm``) or PNG (``.png``)."""
    suffix = Path(path).suffix.lower()
    try:
        if suffix in (".html", ".htm"):
            Path(path).write_text(to_html(drawing), encoding="utf-8")
        elif suffix == ".png":
            to_png(drawing, path)
        else:
            raise TimelineError(f"--timeline: unknown format {suffix or '(none)'}; "
                                "use OUT.html or OUT.png")
    except OSError as exc:
        raise TimelineError(f"cannot write {os.fspath(path)}: {exc.strerror}") from None


def to_html(d: Drawing) -> str:
    """A self-contained page: the SVG inline, no scripts, no external resources."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(d.title)}</title>\n"
        "<style>body{font-family:system-ui,sans-serif;margin:16px;color:#111827}"
        "svg{border:1px solid #e5e7eb}</style>\n</head>\n<body>\n"
        f"{to_svg(d)}\n</body>\n</html>\n"
    )


def to_svg(d: Drawing) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{d.width}" height="{d.height}" '
           f'viewBox="0 0 {d.width} {d.height}" font-family="sans-serif">',
           f'<rect width="{d.width}" height="{d.height}" fill="#ffffff"/>']
    out += [_svg(s) for s in d.background]
    for row in d.rows:
        out.append(f'<g class="row" data-rid="{html.escape(row.rid, quote=True)}">')
        out += [_svg(s) for s in row.shapes]
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _title(text: str) -> str:
    return f"<title>{html.escape(text)}</title>" if text else ""


def _svg(s: Shape) -> str:
    if isinstance(s, Rect):
        stroke = f' stroke="{s.stroke}" stroke-width="1.5"' if s.stroke else ""
        body = _title(s.title)
        tag = (f'<rect x="{s.x:.2f}" y="{s.y:.2f}" width="{s.w:.2f}" height="{s.h:.2f}" '
               f'fill="{s.fill}"{stroke}')
        return f"{tag}>{body}</rect>" if body else f"{tag}/>"
    if isinstance(s, Seg):
        return (f'<line x1="{s.x1:.2f}" y1="{s.y1:.2f}" x2="{s.x2:.2f}" y2="{s.y2:.2f}" '
                f'stroke="{s.stroke}" stroke-width="{s.width}"/>')
    if isinstance(s, Text):
        return (f'<text x="{s.x:.2f}" y="{s.y:.2f}" font-size="{s.size}" fill="{s.fill}" '
                f'text-anchor="{s.anchor}">{html.escape(s.text)}</text>')
    points = " ".join(f"{x:.2f},{y:.2f}" for x, y in _mark_points(s))
    if s.shape == "cross":
        return (f'<polyline points="{points}" fill="none" stroke="{s.fill}" '
                f'stroke-width="2">{_title(s.title)}</polyline>')
    return f'<polygon points="{points}" fill="{s.fill}">{_title(s.title)}</polygon>'


def _mark_points(m: Mark, r: float = 5.0) -> list[tuple[float, float]]:
    x, y = m.x, m.y
    if m.shape == "triangle":
        return [(x - r, y - r), (x + r, y - r), (x, y + r)]
    if m.shape == "diamond":
        return [(x, y - r), (x + r, y), (x, y + r), (x - r, y)]
    # A cross as one polyline: corner to corner, then the other diagonal through the centre.
    return [(x - r, y - r), (x + r, y + r), (x, y), (x + r, y - r), (x - r, y + r)]


def to_png(d: Drawing, path: str | os.PathLike[str]) -> None:
    """Render with Pillow (the same shapes as the SVG)."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise TimelineError("PNG output needs Pillow (pip install pillow); "
                            "or write the timeline as .html") from None
    img = Image.new("RGB", (d.width, d.height), "#ffffff")
    draw = ImageDraw.Draw(img)
    fonts: dict[int, object] = {}

    def font(size: int) -> object:
        if size not in fonts:
            try:
                fonts[size] = ImageFont.load_default(size=size)
            except TypeError:  # Pillow < 10.1: one bitmap size
                fonts[size] = ImageFont.load_default()
        return fonts[size]

    shapes = list(d.background) + [s for row in d.rows for s in row.shapes]
    for s in shapes:
        if isinstance(s, Rect):
            box = (s.x, s.y, s.x + s.w, s.y + s.h)
            draw.rectangle(box, fill=None if s.fill == "none" else s.fill, outline=s.stroke)
        elif isinstance(s, Seg):
            draw.line((s.x1, s.y1, s.x2, s.y2), fill=s.stroke, width=max(1, round(s.width)))
        elif isinstance(s, Text):
            f = font(s.size)
            try:
                anchor = {"start": "ls", "middle": "ms", "end": "rs"}[s.anchor]
                draw.text((s.x, s.y), s.text, fill=s.fill, font=f, anchor=anchor)  # type: ignore[arg-type]
            except ValueError:  # a bitmap font takes no anchor: place it by hand
                w = draw.textlength(s.text, font=f)  # type: ignore[arg-type]
                dx = {"start": 0.0, "middle": w / 2, "end": w}[s.anchor]
                draw.text((s.x - dx, s.y - s.size), s.text, fill=s.fill, font=f)  # type: ignore[arg-type]
        elif s.shape == "cross":
            draw.line(_mark_points(s), fill=s.fill, width=2)
        else:
            draw.polygon(_mark_points(s), fill=s.fill)
    img.save(os.fspath(path), format="PNG")
