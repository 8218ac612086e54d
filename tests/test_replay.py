"""``actorllm replay``: checking, summarising, drawing and re-driving real and edited traces.

One real trace is recorded once per module with the tiny Llama: plain requests, a
``n = 2`` request, an abort before anything ran, an abort mid-generation, a stop string,
and a KV pool small enough (16 blocks of 4 tokens) that the Scheduler preempts. Hand-edited
copies of it must fail with the right rid and event.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from actorllm.config import EngineConfig
from actorllm.engine.async_engine import Resources, open_engine
from actorllm.lifecycle.table import State, load_spec, parse_spec
from actorllm.llm import make_request
from actorllm.replay import (
    check_trace,
    load_trace,
    parse_trace,
    percentile,
    redrive,
    replay_main,
    summarize,
)
from actorllm.replay.check import check_session
from actorllm.replay.timeline import STATE_COLOURS, Rect, Text, build_timeline
from actorllm.wire.messages import SamplingParams

SPEC = load_spec()
PROMPTS = {
    "plain-0": "The river runs past the old mill",
    "plain-1": "Hello! How are you today?",
    "plain-2": "What is the capital of France?",
    "stopper": "The baker opens at six.",
}


# --- the recorded trace ------------------------------------------------------------------


async def _record(config: EngineConfig, resources: Resources) -> dict[str, dict[str, Any]]:
    """Run the scenario; returns what each client received: rid -> tokens and reason."""
    got: dict[str, dict[str, Any]] = {}

    async with open_engine(config, resources=resources) as engine:

        async def client(rid: str, prompt: str, params: SamplingParams,
                         abort_at: int | None = None) -> None:
            collector = await engine.submit(make_request(rid, prompt, params))
            if abort_at == 0:
                await engine.abort(rid)
            async for out in collector:
                for o in out.outputs:
                    leaf = rid if params.n == 1 else f"{rid}-{o.index}"
                    entry = got.setdefault(leaf, {"tokens": 0, "reason": None})
                    entry["tokens"] += len(o.token_ids)
                    entry["reason"] = o.finish_reason or entry["reason"]
                    if abort_at and entry["tokens"] >= abort_at:
                        abort_at = None
                        await engine.abort(rid)

        base = SamplingParams(max_tokens=12, seed=7)
        async with trio.open_nursery() as nursery:
            for rid, prompt in PROMPTS.items():
                stop = ("e",) if rid == "stopper" else ()
                nursery.start_soon(client, rid, prompt, SamplingParams(
                    max_tokens=12, seed=len(rid), stop=stop))
            nursery.start_soon(client, "fan", "Thank you for your help.",
                               SamplingParams(n=2, max_tokens=12, seed=3))
            nursery.start_soon(client, "abort-early", "The train leaves", base, 0)
            nursery.start_soon(client, "abort-mid", "A small library", base, 2)
        assert await engine.wait_drained() == []
    return got


@pytest.fixture(scope="module")
def recorded(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, dict[str, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("replay") / "trace.jsonl"
    config = EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=16,
                          max_model_len=64, trace=str(path))
    got = trio.run(_record, config, Resources(config))
    return path, got


@pytest.fixture()
def trace_path(recorded: tuple[Path, dict[str, dict[str, Any]]]) -> Path:
    return recorded[0]


def _args(path: Path, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(file=path, timeline=kw.get("timeline"),
                              redrive=kw.get("redrive", False), json=kw.get("json", False))


def _run_json(path: Path, capsys: pytest.CaptureFixture[str], **kw: Any
              ) -> tuple[int, dict[str, Any]]:
    code = replay_main(_args(path, json=True, **kw))
    return code, json.loads(capsys.readouterr().out)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# --- a real trace passes -----------------------------------------------------------------


def test_real_trace_is_legal_and_complete(trace_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _run_json(trace_path, capsys)
    assert report["check"]["violations"] == []
    assert code == 0 and report["ok"]
    # Every leaf and every parent of the scenario is there.
    rids = {r["rid"] for r in report["requests"]}
    assert {*PROMPTS, "fan", "fan-0", "fan-1", "abort-early", "abort-mid"} <= rids


def test_real_trace_exercises_the_hard_paths(trace_path: Path) -> None:
    """The scenario is only worth something if it preempts, aborts and gathers."""
    events = [x.get("event") for x in _lines(trace_path)]
    assert "preempt" in events
    assert "abort" in events
    assert "gather" in events


def test_redrive_makes_the_same_decisions(trace_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _run_json(trace_path, capsys, redrive=True)
    rd = report["redrive"]
    assert rd["ok"], rd["divergences"]
    assert rd["plans"] > 0 and rd["decisions"] > rd["plans"]
    assert code == 0


def test_summary_counts_what_the_clients_received(
        recorded: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    path, got = recorded
    summary = summarize(load_trace(path, SPEC), SPEC)
    by_rid = {r.rid: r for r in summary.requests}
    for rid, client in got.items():
        mine = by_rid[rid]
        assert mine.reason == client["reason"], rid
        if rid == "stopper" and client["reason"] == "stop":
            # Tokens after the stop string are committed but never shown.
            assert mine.tokens >= client["tokens"]
        else:
            assert mine.tokens == client["tokens"], rid
    assert by_rid["abort-mid"].reason == "abort"
    assert by_rid["abort-early"].reason == "abort"
    assert by_rid["fan"].children == ["fan-0", "fan-1"]
    assert by_rid["fan-0"].parent == "fan"


def test_summary_totals_are_consistent(trace_path: Path) -> None:
    trace = load_trace(trace_path, SPEC)
    summary = summarize(trace, SPEC)
    totals = summary.totals()
    leaves = summary.leaves
    assert totals["requests"] == len(leaves) == 8
    assert sum(totals["by_reason"].values()) == len(leaves)
    assert totals["tokens"] == sum(r.tokens for r in leaves)
    assert totals["aborted"] == sum(r.reason == "abort" for r in leaves) >= 2
    assert totals["aborts"] >= 2
    assert totals["preemptions"] == sum(x.get("event") == "preempt" for x in _lines(trace_path))
    result_tokens = sum(len(x["tokens"]) for x in _lines(trace_path) if x.get("kind") == "result")
    assert result_tokens == totals["tokens"] + totals["late_drops"]
    for r in leaves:
        if r.tokens:
            assert r.ttft_s is not None and r.ttft_s > 0
            assert r.queue_s is not None and r.queue_s >= 0
            assert r.e2e_s is not None and r.e2e_s >= r.ttft_s
            assert len(r.itls) == r.tokens - 1


def test_text_report(trace_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_main(_args(trace_path, redrive=True)) == 0
    out = capsys.readouterr().out
    assert "legal and complete" in out
    assert "abort-mid" in out and "totals" in out and "redrive" in out


# --- the timeline ------------------------------------------------------------------------


def test_timeline_html_has_one_row_per_request(trace_path: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "timeline.html"
    code, report = _run_json(trace_path, capsys, timeline=out)
    assert code == 0
    page = out.read_text()
    assert page.count('<g class="row"') == len(report["requests"]) == 9
    for r in report["requests"]:
        assert f'data-rid="{r["rid"]}"' in page
    # Self-contained: no scripts, no external resources.
    assert "<script" not in page and "src=" not in page and "href=" not in page
    assert "preempted" in page and "aborted" in page  # the marks' tooltips


def test_timeline_png(trace_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    out = tmp_path / "timeline.png"
    assert replay_main(_args(trace_path, timeline=out)) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_unknown_format_is_a_usage_error(trace_path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_main(_args(trace_path, timeline=tmp_path / "t.svgz")) == 2
    assert "OUT.html or OUT.png" in capsys.readouterr().err


# --- hand-edited traces fail with the right rid and event --------------------------------


def _edit_drop(lines: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """Drop the rid's enqueue line: its schedule comes from TOKENIZING."""
    return [x for x in lines if not (x.get("rid") == rid and x.get("event") == "enqueue")]


def _edit_duplicate_terminal(lines: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    out = []
    for x in lines:
        out.append(x)
        if x.get("rid") == rid and x.get("event") in SPEC.terminal_events:
            out.append(dict(x, t=x["t"] + 1e-7))
    return out


def _edit_free_before_finish(lines: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """Swap the times of the rid's terminal event and its free (a reorder in time)."""
    out = [dict(x) for x in lines]
    fin = next(x for x in out if x.get("rid") == rid and x.get("event") in SPEC.terminal_events)
    free = next(x for x in out if x.get("rid") == rid and x.get("event") == "free")
    fin["t"], free["t"] = free["t"], fin["t"]
    return out


def _edit_wrong_actor(lines: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    out = [dict(x) for x in lines]
    next(x for x in out if x.get("rid") == rid and x.get("event") == "schedule")["actor"] = (
        "frontend")
    return out


def _edit_truncate(lines: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """Cut the file just after the rid's terminal event: it never gets RELEASED."""
    i = next(i for i, x in enumerate(lines)
             if x.get("rid") == rid and x.get("event") in SPEC.terminal_events)
    return lines[: i + 1]


@pytest.mark.parametrize(
    ("edit", "rid", "kind", "event", "state"),
    [
        (_edit_drop, "plain-1", "illegal", "schedule", "TOKENIZING"),
        (_edit_duplicate_terminal, "plain-2", "illegal", None, "FINISHED"),
        (_edit_free_before_finish, "plain-0", "illegal", "free", "RUNNING"),
        (_edit_wrong_actor, "fan-1", "wrong-actor", "schedule", "WAITING"),
        (_edit_truncate, "plain-2", "incomplete", None, "FINISHED"),
    ],
    ids=["drop-line", "duplicate-terminal", "free-before-finish", "wrong-actor", "truncated"],
)
def test_edited_trace_fails_with_the_right_rid_and_event(
        trace_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any,
        rid: str, kind: str, event: str | None, state: str) -> None:
    lines = edit(_lines(trace_path), rid)
    path = _write(tmp_path / "edited.jsonl", lines)
    code, report = _run_json(path, capsys)
    assert code == 1 and not report["ok"]
    mine = [v for v in report["check"]["violations"] if v["rid"] == rid]
    assert mine, report["check"]["violations"]
    v = mine[0]
    assert v["kind"] == kind
    if event is not None:
        assert v["event"] == event
    if edit is _edit_duplicate_terminal:
        assert v["event"] in SPEC.terminal_events
    if kind != "wrong-actor":
        assert v["state"] == state or (state == "FINISHED" and v["state"] == "RESPONDED")
    assert v["context"] and v["line"] is not None
    assert set(v["expected"]) == set(SPEC.expected_events(v["state"]))
    # The text report names the rid, the event and shows the lines around it.
    assert replay_main(_args(path)) == 1
    text = capsys.readouterr().out
    assert rid in text and "expected one of" in text
    if event is not None:
        assert repr(event) in text


def test_gather_before_a_child_is_released_breaks_invariant_6(
        trace_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [dict(x) for x in _lines(trace_path)]
    child_free = next(x for x in lines if x.get("rid") == "fan-1" and x.get("event") == "free")
    gather = next(x for x in lines if x.get("rid") == "fan" and x.get("event") == "gather")
    gather["t"] = child_free["t"] - 1e-6
    code, report = _run_json(_write(tmp_path / "early.jsonl", lines), capsys)
    assert code == 1
    (v,) = [v for v in report["check"]["violations"] if v["rid"] == "fan"]
    assert v["kind"] == "invariant-6" and v["event"] == "gather" and "fan-1" in v["message"]


def test_redrive_reports_a_different_decision(trace_path: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Twice the KV blocks: the re-driven Scheduler does not preempt where it did."""
    lines = _lines(trace_path)
    config = lines[0]["config"]
    for key in ("num_kv_blocks", "num_kv_blocks_used"):
        if key in config:
            config[key] *= 2
    for line in lines:  # the Scheduler's own record of its pool wins over the header
        if line.get("kind") == "config":
            line["num_blocks"] *= 2
    code, report = _run_json(_write(tmp_path / "bigger.jsonl", lines), capsys, redrive=True)
    assert code == 1 and report["check"]["ok"]
    (d,) = report["redrive"]["divergences"]
    assert d["recorded"] != d["redriven"] and d["message"].startswith("recorded")


def test_redrive_reports_a_dropped_result(trace_path: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(trace_path)
    i = next(i for i, x in enumerate(lines) if x.get("kind") == "result")
    code, report = _run_json(_write(tmp_path / "noresult.jsonl", lines[:i] + lines[i + 1:]),
                             capsys, redrive=True)
    assert code == 1 and not report["redrive"]["ok"]


# --- synthetic traces: the checker's corners, no model needed -----------------------------


def _leaf(rid: str, t: float, events: list[str] | None = None) -> list[dict[str, Any]]:
    events = events or ["register", "dispatch", "enqueue", "schedule", "finish", "free",
                        "respond", "forget"]
    out = []
    for i, e in enumerate(events):
        actor = SPEC.actor_of(e)
        extra = {"reason": "length"} if e in ("finish", "respond") else {}
        out.append({"t": t + i * 0.001, "actor": actor, "rid": rid, "event": e, "from": "",
                    "to": "", **extra})
    return out


HEADER = {"kind": "header", "spec_version": SPEC.version, "model": "m", "config": {}, "t0": 0.0}


def test_reused_rid_is_two_lives(tmp_path: Path) -> None:
    path = _write(tmp_path / "reuse.jsonl", [HEADER, *_leaf("r", 1.0), *_leaf("r", 2.0)])
    trace = load_trace(path, SPEC)
    assert [incarnation.name for incarnation in trace.incarnations] == ["r", "r#2"]
    assert check_trace(trace, SPEC) == []


def test_timeline_has_a_colour_and_a_legend_entry_for_every_state_of_the_table() -> None:
    assert set(STATE_COLOURS) == set(SPEC.states), "a table state the timeline cannot draw"
    assert len(set(STATE_COLOURS.values())) == len(STATE_COLOURS), "two states look alike"
    trace = parse_trace([json.dumps(x) for x in [HEADER, *_leaf("r", 1.0)]], SPEC)
    drawing = build_timeline(trace, SPEC, summarize(trace, SPEC), [])
    legend = {s.text for s in drawing.background if isinstance(s, Text)}
    assert set(SPEC.states) <= legend


def test_timeline_draws_a_paused_stretch_in_its_own_colour() -> None:
    events = ["register", "dispatch", "enqueue", "schedule", "pause", "resume", "schedule",
              "finish", "free", "respond", "forget"]
    trace = parse_trace([json.dumps(x) for x in [HEADER, *_leaf("r", 1.0, events)]], SPEC)
    assert check_trace(trace, SPEC) == []
    drawing = build_timeline(trace, SPEC, summarize(trace, SPEC), [])
    (row,) = drawing.rows
    paused = [s for s in row.shapes if isinstance(s, Rect) and ": PAUSED from" in s.title]
    assert len(paused) == 1 and paused[0].fill == STATE_COLOURS[State.PAUSED]


def test_several_runs_in_one_file_are_sessions(tmp_path: Path) -> None:
    path = _write(tmp_path / "two.jsonl", [HEADER, *_leaf("r", 1.0), HEADER, *_leaf("r", 2.0)])
    trace = load_trace(path, SPEC)
    assert [incarnation.name for incarnation in trace.incarnations] == ["0:r", "1:r"]
    assert check_trace(trace, SPEC) == []


def test_unknown_event_and_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [HEADER, *_leaf("r", 1.0)]
    lines[3]["event"] = "teleport"
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "{not json\n")
    code, report = _run_json(path, capsys)
    assert code == 1
    kinds = {(v["rid"], v["kind"]) for v in report["check"]["violations"]}
    assert ("r", "illegal") in kinds and ("-", "format") in kinds
    (v,) = [v for v in report["check"]["violations"] if v["rid"] == "r"]
    assert v["event"] == "teleport" and "not an event" in v["message"]


def test_unreadable_files_are_usage_errors(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_main(_args(tmp_path / "missing.jsonl")) == 2
    (tmp_path / "empty.jsonl").write_text("")
    assert replay_main(_args(tmp_path / "empty.jsonl")) == 2
    assert "error" in capsys.readouterr().err


def test_invariant_2_is_checked_even_where_the_table_would_allow_it() -> None:
    """With a table in which ``finish`` is no terminal event, a finished request has none."""
    text = (Path(__file__).parents[1] / "spec" / "lifecycle.toml").read_text()
    loose = parse_spec(text.replace('terminal_events = ["finish", ', 'terminal_events = ['))
    trace = parse_trace([json.dumps(x) for x in [HEADER, *_leaf("r", 1.0)]], loose)
    (v,) = check_session(trace.sessions[0], loose)
    assert v.kind == "invariant-2" and v.rid == "r"


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)


def test_redrive_needs_the_pool_size(tmp_path: Path) -> None:
    from actorllm.replay import RedriveError

    lines = [HEADER, {"t": 1.0, "kind": "input", "actor": "scheduler", "msg": "SequenceRequest",
                      "rid": "r", "prompt_tokens": 3, "max_tokens": 2}]
    trace = load_trace(_write(tmp_path / "t.jsonl", lines), SPEC)
    with pytest.raises(RedriveError, match="num_kv_blocks"):
        redrive(trace)


def test_recorded_sampling_params_come_back_whole() -> None:
    """What ``attrs.asdict`` + JSON make of SamplingParams, the re-drive turns back."""
    import attrs

    from actorllm.replay.redrive import _params

    params = SamplingParams(max_tokens=5, min_tokens=2, stop=("x",), stop_token_ids=(3, 4),
                            ignore_eos=True, logit_bias=((1, 2.0),))
    raw = json.loads(json.dumps(attrs.asdict(params)))
    assert _params(raw, 5) == params
    assert _params(None, 7) == SamplingParams(max_tokens=7)


def test_a_hand_driven_scheduler_redrives_identically(tmp_path: Path) -> None:
    """No model: the real Scheduler, traced, driven by hand through preemption, an abort
    with a step in flight (the fence) and a late result; then re-driven from its trace.
    The pool size comes from a ``config`` record, as a Scheduler may write one."""
    from actorllm.lifecycle.trace import Tracer
    from actorllm.scheduler.actor import Scheduler
    from actorllm.wire.messages import AbortRequest, SampledToken, SequenceRequest, StepResult

    path = tmp_path / "sched.jsonl"
    tracer = Tracer(path)
    tracer.header("no-model", {"block_size": 2, "max_num_seqs": 8}, SPEC.version)
    tracer.record("config", actor="scheduler", num_blocks=6, block_size=2)
    sched = Scheduler(None, None, None, num_blocks=6, block_size=2,  # type: ignore[arg-type]
                      tracer=tracer)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for rid in ("a", "b", "c"):
        sched.handle(SequenceRequest(rid, (5, 6, 7), params, 6, (1,)))
    for step in range(12):
        plan = sched.schedule()
        if plan is None:
            break
        if step == 2:
            sched.handle(AbortRequest("b"))  # while its step is in flight
        sched.handle(StepResult.of_tokens(plan, (SampledToken(s.rid, 9)
                                                 for s in plan.seqs if s.sample)))
    tracer.close()
    assert sched.num_preemptions > 0 and sched.late_results_dropped > 0
    trace = load_trace(path, SPEC)
    report = redrive(trace)
    assert report.ok, report.divergences
    assert report.plans > 3 and report.decisions > report.plans
    # Without the abort input, the re-driven Scheduler does not abort where it did.
    lines = [x for x in _lines(path) if x.get("msg") != "abort"]
    bad = redrive(load_trace(_write(tmp_path / "noabort.jsonl", lines), SPEC))
    (d,) = bad.divergences
    assert d.recorded == ("abort", "b", "abort")
