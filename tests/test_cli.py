"""The ``actorllm`` command as a user runs it: subprocesses, exit codes, output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def actorllm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actorllm", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys\nfrom actorllm.cli import build_parser\n"
            "try:\n    build_parser().parse_args(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "run" in out.stdout and "serve" in out.stdout and "replay" in out.stdout


@pytest.mark.parametrize("given,want", [
    ({}, "None 10000 False"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None False"),
    ({"GOMP_SPINCOUNT": "5"}, "None 5 False"),
])
def test_openmp_spin_is_set_before_torch_loads(given: dict[str, str], want: str) -> None:
    """The CLI makes torch's OpenMP threads spin only briefly before they sleep unless
    the user chose a wait policy or a spin, and does it before anything imports torch
    (libgomp reads them once, when it loads)."""
    code = ("import os, sys\nfrom actorllm import cli\n"
            "cli.cmd_run = lambda args: print(os.environ.get('OMP_WAIT_POLICY'),"
            " os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules) or 0\n"
            "sys.exit(cli.main(['run', 'x']))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(given)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == want.split()


def test_run_without_model_uses_the_embedded_model() -> None:
    out = actorllm("run", "The os module provides", "--max-tokens", "24", "--seed", "0")
    assert out.returncode == 0, out.stderr
    text = out.stdout.strip()
    assert len(text) > 10
    assert sum(c.isalpha() for c in text) > len(text) / 2  # language-like, not noise


def test_jsonl_output_one_line_per_prompt_and_choice(tiny_llama_dir: Path) -> None:
    out = actorllm("run", "hello", "the quick brown fox", "--model", str(tiny_llama_dir),
                   "--max-tokens", "5", "--temperature", "0", "--n", "2", "--ignore-eos",
                   "--output", "jsonl")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["prompt"], r["index"]) for r in rows] == [
        ("hello", 0), ("hello", 1), ("the quick brown fox", 0), ("the quick brown fox", 1)]
    for r in rows:
        assert set(r) == {"prompt", "index", "text", "token_ids", "finish_reason", "usage"}
        assert len(r["token_ids"]) == 5 and r["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 5 and r["usage"]["prompt_tokens"] > 0
    assert rows[0]["token_ids"] == rows[1]["token_ids"]  # greedy: both choices agree


def test_prompts_file_and_one_bad_prompt_fails_alone(tiny_llama_dir: Path,
                                                     tmp_path: Path) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    out = actorllm("run", "--prompts-file", str(f), "", "--model", str(tiny_llama_dir),
                   "--max-tokens", "3", "--output", "jsonl")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 1  # a prompt failed; the others still ran
    assert [r.get("error") is None for r in rows] == [False, True, True]
    assert "empty" in rows[0]["error"]
    assert "prompt 0: error:" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "x", "--model", "/nonexistent/model"], "model directory not found"),
        (["run", "x", "--temperature", "-1"], "temperature"),
        (["run", "x", "--block-size", "0"], "--block-size"),
        (["run"], "at least one PROMPT"),
        (["run", "--prompts-file", "/nonexistent/file"], "cannot read --prompts-file"),
        (["run", "x", "--attention-backend", "cuda"], "cuda"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = actorllm(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actorllm: error:"), out.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--trace", "/nonexistent/t.jsonl"],
         "--trace /nonexistent/t.jsonl: the directory /nonexistent does not exist"),
        (["run", "x", "--trace", "/"], "--trace /: is a directory"),
        (["serve", "--log-level", "LOUD"], "--log-level must be one of"),
        (["replica", "--log-level", "LOUD"], "--log-level must be one of"),
        (["serve", "--max-request-bytes", "-1"], "--max-request-bytes must be positive, got -1"),
        (["serve", "--max-request-bytes", "0"], "--max-request-bytes must be positive, got 0"),
        (["serve", "--drain-timeout", "-1"], "--drain-timeout must be 0 or more, got -1.0"),
        (["serve", "--max-stream-hold", "-1"], "--max-stream-hold must be 0 or more, got -1.0"),
        (["serve", "--max-pending", "0"], "--max-pending must be positive, got 0"),
        (["serve", "--body-timeout", "nan"], "--body-timeout must be 0 or more, got nan"),
        (["run", "x", "--cuda-graphs"], "--cuda-graphs needs --device cuda, got --device cpu"),
    ],
)
def test_bad_flags_are_refused_before_the_model_loads(args: list[str], message: str) -> None:
    # Each would otherwise load the model first (or serve with a useless limit); here the
    # model is one that cannot load, so only a check before loading can give this line.
    out = actorllm(*args, "--model", "/nonexistent/model", timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [f"actorllm: error: {lines[0].removeprefix('actorllm: error: ')}"]
    assert message in lines[0], lines


def test_a_missing_tokenizer_is_one_whole_line(tmp_path: Path) -> None:
    from actorllm.config import default_model_dir

    model = tmp_path / "no-tokenizer"
    model.mkdir()
    (model / "config.json").write_bytes((default_model_dir() / "config.json").read_bytes())
    out = actorllm("run", "x", "--model", str(model))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"actorllm: error: cannot load a tokenizer from {model}: "), out.stderr
    assert not lines[0].rstrip().endswith(":"), lines  # the reason is all there


def test_a_prompt_longer_than_the_context_is_said_plainly(tiny_llama_dir: Path) -> None:
    out = actorllm("run", "word " * 40, "--model", str(tiny_llama_dir), "--max-model-len", "10")
    assert "maximum context length is 10 tokens" in out.stderr, out.stderr
    assert "the prompt alone has" in out.stderr and "more than the context holds" \
        in out.stderr, out.stderr
    assert "-" not in out.stderr.split("maximum context length")[1].split(".")[1], out.stderr


@pytest.mark.parametrize(("command", "serving"), [("serve", True), ("run", False)])
def test_only_serve_tells_the_engine_its_loop_serves_http(command: str, serving: bool) -> None:
    """`serve` tells the engine its loop serves HTTP: in `single` on the CPU the Worker
    then leaves that loop a core (placement.worker_threads); under `serve` the Scheduler
    of `single` and `engine` plans the next step while one runs (config.overlap), in
    `engine` not within ARRIVAL_QUIET_S of an arrival; `run` does the same in `single`
    (speculating or not) and `engine`, `pipeline` only if asked, and CUDA always (with
    no spell: not measured there)."""
    from actorllm.cli import build_parser, engine_config
    from actorllm.config import EngineConfig
    from actorllm.topology.placement import ARRIVAL_QUIET_S, arrival_quiet_s

    def config_of(*args: str) -> EngineConfig:
        return engine_config(build_parser().parse_args([command, *args]))

    config = config_of()
    assert config.serving_http is serving
    assert config.overlap
    assert arrival_quiet_s(config) == 0.0  # `single`
    assert not config_of("--no-async-scheduling").overlap
    ngram = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert config_of("--speculative-config", ngram).overlap
    assert not config_of("--speculative-config", ngram, "--no-async-scheduling").overlap
    assert not config_of("--tensor-parallel-size", "2").overlap
    engine = config_of("--topology", "engine")
    assert engine.overlap
    assert arrival_quiet_s(engine) == ARRIVAL_QUIET_S
    assert arrival_quiet_s(config_of("--topology", "engine", "--no-async-scheduling")) == 0.0
    assert not config_of("--topology", "pipeline").overlap
    assert arrival_quiet_s(config_of("--topology", "pipeline", "--async-scheduling")) \
        == ARRIVAL_QUIET_S
    assert config_of("--topology", "engine", "--async-scheduling").overlap
    assert config_of("--device", "cuda").overlap
    assert arrival_quiet_s(config_of("--device", "cuda", "--topology", "engine")) == 0.0
