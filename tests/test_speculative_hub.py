"""A draft model named by hub id (``{"method": "draft_model", "model": "ORG/NAME"}``),
resolved through the hub cache as ``--model ORG/NAME`` is, offline: the test fills the
cache itself (``test_hub.fill_cache``: main and a branch v2 with other weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hub import COMMIT, V2

from actorllm.config import EngineConfig, SpeculativeConfig
from actorllm.llm import LLM
from actorllm.wire.messages import SamplingParams

ID = "tiny-org/tiny-llama"


def spec(model: str, **more: object) -> dict[str, object]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3, **more}


def test_a_draft_id_resolves_to_its_snapshot_at_a_revision(hub: Path) -> None:
    snapshots = hub / "models--tiny-org--tiny-llama" / "snapshots"
    assert SpeculativeConfig.parse(spec(ID)).model == str(snapshots / COMMIT)
    assert SpeculativeConfig.parse(spec(ID, revision="v2")).model == str(snapshots / V2)
    with pytest.raises(ValueError, match="revision must be a non-empty string"):
        SpeculativeConfig.parse(spec(ID, revision=2))
    with pytest.raises(ValueError, match="revision applies to a hub id"):
        SpeculativeConfig.parse(spec(str(snapshots / COMMIT), revision="v2"))


def test_a_draft_by_id_keeps_greedy_output_exact(hub: Path, tmp_path: Path) -> None:
    # The draft is v2 (other weights, same vocabulary): mostly rejected, output unchanged.
    target = str(tmp_path / "src")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(target, num_kv_blocks=64).generate(["hello world"], params)
    llm = LLM(target, num_kv_blocks=64, speculative_config=spec(ID, revision="v2"))
    drafted = llm.generate(["hello world"], params)
    assert drafted[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert len(drafted[0].outputs[0].token_ids) == 8


def test_a_draft_id_not_in_the_cache_is_one_line_and_exit_2(hub: Path, tmp_path: Path) -> None:
    target = str(tmp_path / "src")
    with pytest.raises(ValueError) as err:
        EngineConfig(model=target, speculative_config=spec("tiny-org/absent"))
    message = str(err.value)
    assert message.startswith("--speculative-config: draft model 'tiny-org/absent'")
    assert str(hub) in message and "HF_HUB_OFFLINE" in message and "\n" not in message
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "actorllm", "run", "--model", target, "--speculative-config",
         json.dumps(spec("tiny-org/absent", revision="v9")), "hello"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny-org/absent@v9" in lines[0] and str(hub) in lines[0], lines
