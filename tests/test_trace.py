"""``--trace FILE``: what a real run writes, and the docs that describe it.

A ``run`` through the command line with the tiny Llama must write a header, one line per
transition, the Scheduler's records and (with ``--trace-hops``) every mailbox hop, with
the fields spec/lifecycle.toml lists; ``actorllm replay`` must find it legal and
complete. spec/README.md embeds the state diagram generated from the table: a test keeps
the two equal.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tomllib
from pathlib import Path

import pytest
import trio

from actorllm.cli import main
from actorllm.config import EngineConfig
from actorllm.engine.async_engine import open_engine
from actorllm.lifecycle.table import load_spec
from actorllm.lifecycle.trace import Tracer
from actorllm.llm import collect
from actorllm.wire.messages import SamplingParams

ROOT = Path(__file__).parents[1]
SPEC = load_spec()
FIELDS = tomllib.loads((ROOT / "spec" / "lifecycle.toml").read_text())["trace"]


@pytest.fixture(scope="module")
def cli_run(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, list[dict[str, object]]]:
    """Two prompts, n = 2, through ``actorllm run --trace --trace-hops``; the trace, and
    the JSON lines the command printed."""
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", "--model", str(tiny_llama_dir), "--trace", str(path),
                     "--trace-hops", "--max-tokens", "6", "--n", "2", "--seed", "1",
                     "--block-size", "4", "--num-kv-blocks", "16", "--max-model-len", "64",
                     "--output", "jsonl", "The river runs", "Hello there"])
    assert code == 0
    return path, [json.loads(x) for x in out.getvalue().splitlines()]


@pytest.fixture()
def cli_trace(cli_run: tuple[Path, list[dict[str, object]]]) -> Path:
    return cli_run[0]


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_header_comes_first(cli_trace: Path) -> None:
    header, *rest = _lines(cli_trace)
    assert header["kind"] == "header"
    assert set(FIELDS["header"]) <= set(header)
    assert header["spec_version"] == SPEC.version
    assert header["config"]["num_kv_blocks"] == 16  # type: ignore[index]
    assert all(x.get("kind") != "header" for x in rest)


def test_transition_lines_have_the_spec_fields(cli_trace: Path) -> None:
    transitions = [x for x in _lines(cli_trace) if "event" in x]
    assert transitions
    for x in transitions:
        assert set(FIELDS["transition"]) <= set(x), x
        assert x["actor"] == SPEC.actor_of(str(x["event"]))
        # from/to are the firing actor's view: states of the table, maybe joined by "|".
        for side in (x["from"], x["to"]):
            assert set(str(side).split("|")) <= {*SPEC.states, "NONE"}
    events = {x["event"] for x in transitions}
    assert {"register", "fan_out", "dispatch", "enqueue", "schedule", "finish", "free",
            "respond", "forget", "gather"} <= events
    times = [float(x["t"]) for x in transitions]  # type: ignore[arg-type]
    assert times == sorted(times)  # one process: file order is time order


def test_hop_and_scheduler_records(cli_trace: Path) -> None:
    lines = _lines(cli_trace)
    hops = [x for x in lines if x.get("kind") in ("send", "recv")]
    assert hops and all(set(FIELDS["hop"]) <= set(x) for x in hops)
    assert {x["mailbox"] for x in hops} >= {"tokenizer", "scheduler", "worker", "detokenizer",
                                            "frontend"}
    inputs = [x for x in lines if x.get("kind") == "input"]
    assert {x["rid"] for x in inputs if x["msg"] == "SequenceRequest"} == {
        "cli-0-0", "cli-0-1", "cli-1-0", "cli-1-1"}
    assert all({"prompt_tokens", "max_tokens"} <= set(x) for x in inputs
               if x["msg"] == "SequenceRequest")
    plans = [x for x in lines if x.get("kind") == "plan"]
    results = [x for x in lines if x.get("kind") == "result"]
    assert [p["step"] for p in plans] == list(range(len(plans)))
    assert {r["step"] for r in results} <= {p["step"] for p in plans}
    assert all(len(r["tokens"]) <= 4 for r in results)  # type: ignore[arg-type]


def test_replay_finds_the_run_legal_and_complete(
        cli_run: tuple[Path, list[dict[str, object]]],
        capsys: pytest.CaptureFixture[str]) -> None:
    path, printed = cli_run
    assert main(["replay", str(path), "--redrive", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["check"]["violations"] == []
    assert report["redrive"]["ok"]
    assert report["totals"]["requests"] == 4 and report["totals"]["parents"] == 2
    # The summary's token counts are what `run` printed, choice by choice.
    by_rid = {r["rid"]: r for r in report["requests"]}
    prompts = ["The river runs", "Hello there"]
    assert len(printed) == 4
    for p in printed:
        rid = f"cli-{prompts.index(p['prompt'])}-{p['index']}"
        assert by_rid[rid]["tokens"] == len(p["token_ids"]) == p["usage"]["completion_tokens"]
        assert by_rid[rid]["reason"] == p["finish_reason"]


def test_several_processes_write_one_trace(tiny_llama_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--topology engine``: the Scheduler incarnations in a child process that appends to the
    same file; the merged trace is still legal, complete, and re-drives."""
    path = tmp_path / "engine.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", "--model", str(tiny_llama_dir), "--topology", "engine",
                     "--trace", str(path), "--max-tokens", "4", "--n", "2",
                     "--block-size", "4", "--num-kv-blocks", "16", "--max-model-len", "64",
                     "--output", "jsonl", "The river runs"])
    assert code == 0
    lines = _lines(path)
    assert sum(x.get("kind") == "header" for x in lines) == 1
    assert {x.get("actor") for x in lines if "event" in x} == {"frontend", "scheduler"}
    assert any(x.get("kind") == "plan" for x in lines)  # written by the child process
    assert main(["replay", str(path), "--redrive", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["totals"]["requests"] == 2


def test_tracer_lines_from_two_writers_stay_whole(tmp_path: Path) -> None:
    """O_APPEND: two Tracers (think: two processes) on one file never tear a line."""
    path = tmp_path / "t.jsonl"
    a, b = Tracer(path), Tracer(path)
    a.header("m", {"block_size": 4}, SPEC.version)
    for i in range(200):
        (a if i % 2 else b).transition("scheduler", f"r{i}", "enqueue", "TOKENIZING", "WAITING",
                                       {"prompt_tokens": i})
        (b if i % 2 else a).record("plan", actor="scheduler", step=i, seqs=[[f"r{i}", 1, True]])
    a.close()
    b.close()
    lines = _lines(path)
    assert len(lines) == 401 and lines[0]["kind"] == "header"


def _live_task_names() -> list[str]:
    names: list[str] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        names.append(task.name)
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return names


async def test_the_engine_closes_its_trace_only_after_every_actor_has_stopped(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An actor woken with a message just before the engine's cancel runs one more step,
    and that step may write a hop line: closing the file any earlier is a write to a closed
    descriptor (seen once in CI as ``OSError: [Errno 9]``)."""
    alive_at_close: list[list[str]] = []
    real_close = Tracer.close

    def close(self: Tracer) -> None:
        alive_at_close.append([n for n in _live_task_names() if n.startswith("actor:")])
        real_close(self)

    monkeypatch.setattr(Tracer, "close", close)
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64,
                          trace=str(tmp_path / "t.jsonl"), trace_hops=True)
    async with open_engine(config) as engine:
        await collect(engine, "r0", "close me", SamplingParams(max_tokens=3, ignore_eos=True))
    assert alive_at_close == [[]]
    assert any(line.get("kind") == "recv" for line in _lines(tmp_path / "t.jsonl"))


def test_tracer_without_hops_writes_no_hop_lines(tmp_path: Path) -> None:
    t = Tracer(tmp_path / "t.jsonl", hops=False)
    t.hop("frontend", "tokenizer", "send", object())
    t.close()
    assert (tmp_path / "t.jsonl").read_text() == ""


# --- spec/README.md ------------------------------------------------------------------------

README = ROOT / "spec" / "README.md"


def test_readme_diagram_is_the_generated_one() -> None:
    """The Mermaid block in spec/README.md is `python -m actorllm.lifecycle.table --mermaid`."""
    blocks = re.findall(r"```mermaid\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "spec/README.md must embed exactly one mermaid diagram"
    assert blocks[0].strip() == SPEC.mermaid().strip(), (
        "the diagram in spec/README.md is stale: regenerate it with "
        "`python -m actorllm.lifecycle.table --mermaid`")


def test_readme_documents_every_trace_field_and_invariant() -> None:
    text = README.read_text()
    for kind, fields in FIELDS.items():
        for field in fields:
            assert f"`{field}`" in text, f"spec/README.md does not describe {kind} field {field}"
    for number in SPEC.invariants:
        assert re.search(rf"^\|\s*{number}\s*\|", text, flags=re.M), (
            f"spec/README.md's invariant table lacks invariant {number}")
