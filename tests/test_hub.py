"""``--model ORG/NAME`` through the hub cache, offline: the test fills the cache itself.

The cache is laid out as huggingface_hub writes it (``models--ORG--NAME/refs/main`` names
a snapshot ``snapshots/<hash>/`` holding the files), in a directory ``HF_HUB_CACHE``
points at, with ``HF_HUB_OFFLINE=1`` so nothing is fetched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_tiny_model

from actorllm.hub import resolve_model
from actorllm.llm import LLM
from actorllm.wire.messages import SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"
V2 = "fedcba9876543210fedcba9876543210fedcba98"  # the branch v2: other weights


def fill_cache(cache: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    """``tiny-org/tiny-llama`` in ``cache``: main at COMMIT, and a branch v2 at V2 whose
    weights differ (seed 1), laid out as huggingface_hub writes them."""
    repo = cache / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    for ref, commit, seed in (("main", COMMIT, 0), ("v2", V2, 1)):
        src = tmp_path / ("src" if ref == "main" else f"src-{ref}")
        model = build_tiny_model(src, "llama", tokenizer_dir=tokenizer_dir, seed=seed)
        shutil.copytree(model, repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)


def test_an_id_in_the_cache_resolves_to_its_snapshot(hub: Path) -> None:
    path = Path(resolve_model("tiny-org/tiny-llama"))
    assert path == hub / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert Path(resolve_model("tiny-org/tiny-llama", COMMIT)) == path
    v2 = hub / "models--tiny-org--tiny-llama" / "snapshots" / V2
    assert Path(resolve_model("tiny-org/tiny-llama", "v2")) == v2


def test_hf_home_is_honoured(tmp_path: Path, tokenizer_dir: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HF_HUB_CACHE, the cache is ``$HF_HOME/hub``, read when resolving."""
    fill_cache(tmp_path / "home" / "hub", tmp_path, tokenizer_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = Path(resolve_model("tiny-org/tiny-llama"))
    assert path == tmp_path / "home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / \
        COMMIT
    with pytest.raises(ValueError, match=str(tmp_path / "home" / "hub")):
        resolve_model("tiny-org/absent")


def test_a_revision_of_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--revision applies to a hub id"):
        resolve_model(str(tmp_path), "main")


def test_an_id_in_the_cache_generates(hub: Path, tmp_path: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    by_id = LLM("tiny-org/tiny-llama", num_kv_blocks=64).generate(["hello world"], params)
    by_dir = LLM(str(tmp_path / "src"), num_kv_blocks=64).generate(["hello world"], params)
    assert by_id[0].outputs[0].token_ids == by_dir[0].outputs[0].token_ids
    assert len(by_id[0].outputs[0].token_ids) == 5


def test_an_id_not_in_the_cache_is_one_line(hub: Path) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("tiny-org/absent")
    message = str(err.value)
    assert "'tiny-org/absent'" in message and str(hub) in message and "\n" not in message


def test_a_path_that_is_no_id_is_left_to_the_directory_checks(tmp_path: Path) -> None:
    path = str(tmp_path / "nowhere" / "deeper")
    assert resolve_model(path) == path
    with pytest.raises(ValueError, match="model directory not found"):
        LLM(path)


def test_cli_resolves_ids_and_exits_2_on_a_miss(hub: Path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-m", "actorllm", "run", "--num-kv-blocks", "64", "--max-tokens",
           "3", "--ignore-eos", "--temperature", "0", "--output", "jsonl"]
    ok = subprocess.run([*run, "--model", "tiny-org/tiny-llama", "hello"], capture_output=True,
                        text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr
    assert '"token_ids"' in ok.stdout
    # --revision v2 reaches the branch's other weights: other tokens than main's.
    v2 = subprocess.run([*run, "--model", "tiny-org/tiny-llama", "--revision", "v2", "hello"],
                        capture_output=True, text=True, timeout=300, env=env)
    assert v2.returncode == 0, v2.stderr
    tokens = [json.loads(out.stdout.splitlines()[-1])["token_ids"] for out in (ok, v2)]
    assert tokens[0] != tokens[1], tokens
    miss = subprocess.run([*run, "--model", "tiny-org/absent", "hello"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert miss.returncode == 2
    lines = miss.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny-org/absent" in lines[0] and str(hub) in lines[0], lines
