"""``actorllm replay FILE``: check, summarise, draw, re-drive; print a report.

Exit codes: 0 when every request's history is legal and complete, the invariants hold and
(with ``--redrive``) the Scheduler made the same decisions; 1 when anything of that
fails; 2 when the file cannot be read as a trace or the timeline cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from actorllm.exit_codes import EXIT_USAGE, say_error
from actorllm.lifecycle.table import Spec, load_spec
from actorllm.replay.check import Violation, check_trace
from actorllm.replay.redrive import RedriveError, RedriveReport, redrive
from actorllm.replay.summary import Summary, summarize
from actorllm.replay.timeline import TimelineError, build_timeline, write_timeline
from actorllm.replay.tracefile import Trace, TraceError, load_trace

EXIT_OK, EXIT_VIOLATION = 0, 1
TABLE_ROWS = 60  # the text report lists this many requests; --json has them all


def replay_main(args: argparse.Namespace) -> int:
    """The ``replay`` subcommand. ``args``: file, timeline, redrive, json."""
    spec = load_spec()
    try:
        trace = load_trace(args.file, spec)
    except TraceError as exc:
        say_error(exc)
        return EXIT_USAGE
    violations = check_trace(trace, spec)
    summary = summarize(trace, spec)
    warnings = _version_warnings(trace, spec)
    redriven: RedriveReport | None = None
    redrive_error: str | None = None
    if getattr(args, "redrive", False):
        try:
            redriven = redrive(trace)
        except RedriveError as exc:
            redrive_error = str(exc)
    if getattr(args, "timeline", None):
        try:
            write_timeline(build_timeline(trace, spec, summary, violations), args.timeline)
        except TimelineError as exc:
            say_error(exc)
            return EXIT_USAGE
    report = build_report(trace, violations, summary, redriven, redrive_error, warnings)
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        render(report, trace)
    return EXIT_OK if report["ok"] else EXIT_VIOLATION


def build_report(trace: Trace, violations: list[Violation], summary: Summary,
                 redriven: RedriveReport | None, redrive_error: str | None,
                 warnings: list[str]) -> dict[str, Any]:
    """Everything in one JSON-able dict (what ``--json`` prints)."""
    ok = not violations and (redrive_error is None) and (redriven is None or redriven.ok)
    return {
        "file": trace.path,
        "ok": ok,
        "sessions": len(trace.sessions),
        "lines": trace.num_lines,
        "warnings": warnings,
        "check": {"ok": not violations, "requests": len(trace.incarnations),
                  "violations": [v.as_json() for v in violations]},
        "totals": summary.totals(),
        "requests": [r.as_json() for r in summary.requests],
        "redrive": (None if redriven is None and redrive_error is None
                    else {"ok": False, "error": redrive_error} if redrive_error is not None
                    else redriven.as_json() if redriven is not None else None),
    }


def _version_warnings(trace: Trace, spec: Spec) -> list[str]:
    out = []
    for s in trace.sessions:
        if s.header is None:
            out.append(f"session {s.index}: no header line; checked against spec "
                       f"version {spec.version}")
        elif s.header.get("spec_version") != spec.version:
            out.append(f"session {s.index}: written for spec version "
                       f"{s.header.get('spec_version')}, checked against {spec.version}")
    return out


# --- the text report ----------------------------------------------------------------------


def render(report: dict[str, Any], trace: Trace) -> None:
    """Print the report for a person, with rich."""
    from rich.console import Console
    from rich.table import Table

    # A pipe gets 120 columns (rich would wrap at 80), a terminal its own width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    console.print(f"[bold]{report['file']}[/]: {report['lines']} lines, "
                  f"{report['sessions']} session(s), {report['check']['requests']} requests")
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    check = report["check"]
    if check["ok"]:
        console.print("[green]✓[/] every request's history is legal and complete; "
                      "invariants 2 and 6 hold")
    else:
        console.print(f"[red]✗ {len(check['violations'])} request(s) break the spec[/]")
        for v in check["violations"]:
            _render_violation(console, v)
    _render_requests(console, report, Table)
    _render_totals(console, report["totals"])
    rd = report["redrive"]
    if rd is not None:
        if rd.get("error"):
            console.print(f"[red]✗ redrive:[/] {rd['error']}")
        elif rd["ok"]:
            console.print(f"[green]✓[/] redrive: the Scheduler made the same "
                          f"{rd['decisions']} decisions ({rd['plans']} plans, "
                          f"{rd['inputs']} inputs and results)")
        else:
            for d in rd["divergences"]:
                where = f" (line {d['line']})" if d["line"] else ""
                console.print(f"[red]✗ redrive:[/] session {d['session']}, decision "
                              f"{d['index']}{where}: {d['message']}")
        for note in rd.get("notes") or ():
            console.print(f"  [dim]note: {note}[/]")


def _render_violation(console: Any, v: dict[str, Any]) -> None:
    from rich.markup import escape

    head = f"  [bold]{escape(v['rid'])}[/] ({v['kind']}): {escape(v['message'])}"
    if v["line"]:
        head += f" [dim]line {v['line']}[/]"
    console.print(head)
    if v["expected"]:
        console.print(f"    expected one of: {', '.join(v['expected'])}")
    for c in v["context"]:
        mark = "[red]>[/]" if c["line"] == v["line"] else " "
        fields = {k: val for k, val in c.items() if k != "line"}
        console.print(f"    {mark} {c['line']:>6}  " + escape(json.dumps(fields)), soft_wrap=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _render_requests(console: Any, report: dict[str, Any], table_cls: Any) -> None:
    from rich.markup import escape

    rows = report["requests"]
    table = table_cls(title="requests (times in ms)", title_justify="left")
    table.add_column("rid", no_wrap=True, overflow="fold")
    for col in ("reason", "tokens", "queue", "TTFT", "ITL p50", "ITL p99", "e2e", "preempt",
                "late"):
        table.add_column(col, justify="left" if col == "reason" else "right", no_wrap=True)
    for r in rows[:TABLE_ROWS]:
        name = escape(("  " + r["rid"]) if r["parent"] else r["rid"])
        tokens = f"n={len(r['children'])}" if r["children"] else str(r["tokens"])
        table.add_row(name, r["reason"] or f"[red]{r['state'] or '?'}[/]", tokens,
                      _ms(r["queue_s"]), _ms(r["ttft_s"]), _ms(r["itl_p50_s"]),
                      _ms(r["itl_p99_s"]), _ms(r["e2e_s"]), str(r["preemptions"] or ""),
                      str(r["late_drops"] or ""))
    console.print(table)
    if len(rows) > TABLE_ROWS:
        console.print(f"  … {len(rows) - TABLE_ROWS} more (use --json for all)")


def _render_totals(console: Any, t: dict[str, Any]) -> None:
    reasons = ", ".join(f"{k} {v}" for k, v in t["by_reason"].items()) or "none"
    rate = f"{t['tokens_per_s']:.1f} tok/s" if t["tokens_per_s"] else "-"
    console.print(f"[bold]totals[/]: {t['requests']} requests ({reasons}), "
                  f"{t['parents']} n>1 parents; {t['tokens']} tokens in {t['steps']} steps "
                  f"over {t['duration_s'] * 1e3:.1f} ms ({rate})")
    console.print(f"  aborts {t['aborts']} (ended by abort {t['aborted']}), late drops "
                  f"{t['late_drops']}, preemptions {t['preemptions']}; queue p50 "
                  f"{_ms(t['queue_p50_s'])} ms, TTFT p50/p99 {_ms(t['ttft_p50_s'])}/"
                  f"{_ms(t['ttft_p99_s'])} ms, ITL p50/p99 {_ms(t['itl_p50_s'])}/"
                  f"{_ms(t['itl_p99_s'])} ms")

