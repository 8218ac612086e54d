"""Bring your own model through the two edges a user meets: ``actorllm run`` and the server.

For each family of ``test_models_families.py`` (tiny, random weights) the greedy tokens of
transformers' own ``generate`` (eager attention, float32) must come back token for token,
with logprobs within 1e-4, from

* ``actorllm run`` in a subprocess (``--output jsonl`` prints the token ids), and
* ``actorllm serve`` in a subprocess, asked by the ``openai`` SDK with the four prompts
  as one batched completions request,

both with a KV cache too small for the four prompts at once (20 blocks of 4 slots), a token
budget of 8 a step (chunked prefill) and prefix caching on (the prompts share a prefix).
That preemption really happened is asserted, not assumed: from the ``--trace`` file of the
run (a ``preempt`` transition) and from the server's ``/metrics`` counter. One model
directory and one oracle per family serve both edges. Llama runs with ``--model-impl
transformers``, so the transformers path meets the edges on a family the native one has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_models_families import MAX_MODEL_LEN, MAX_NEW, build_family, oracle, prompts
from test_server import ServerProcess, http

# (family, --model-impl): auto is the native model for Qwen3 and Mistral, transformers for the
# rest; Llama goes through the transformers path, so both paths meet the same edges.
FAMILIES = [(f, "auto") for f in ("qwen3", "gemma2", "gemma3", "phi3", "olmo2", "mixtral",
                                  "qwen3_moe", "mistral")] + [("llama", "transformers")]
TIGHT = ["--num-kv-blocks", "20", "--block-size", "4", "--max-num-batched-tokens", "8",
         "--enable-prefix-caching", "--max-model-len", str(MAX_MODEL_LEN)]
Case = tuple[list[str], list[str], list[list[int]], list[tuple[list[int], list[float]]]]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda p: "-".join(p))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         tokenizer_dir: Path) -> Case:
    """(model flags, prompt texts, their ids, the oracle's (ids, logprobs) per prompt)."""
    from transformers import AutoTokenizer

    family, impl = request.param
    model_dir = build_family(tmp_path_factory.mktemp(family), family, tokenizer_dir, seed=1)
    ids = prompts(tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = [tok.decode(p, skip_special_tokens=True) for p in ids]
    assert [tok(t).input_ids for t in texts] == ids  # the engine will tokenize the texts
    flags = ["--model", str(model_dir), "--model-impl", impl]
    return flags, texts, ids, oracle(model_dir, ids)


def _close(got: list[float], want: list[float]) -> None:
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)


def test_actorllm_run(case: Case, tmp_path: Path) -> None:
    flags, texts, ids, want = case
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(texts) + "\n")
    trace = tmp_path / "trace.jsonl"
    cmd = [sys.executable, "-m", "actorllm", "run", *flags, "--prompts-file",
           str(prompts_file), "--max-tokens", str(MAX_NEW), "--temperature", "0",
           "--ignore-eos", "--output", "jsonl", "--trace", str(trace), *TIGHT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == texts
    for row, prompt_ids, (want_ids, _) in zip(rows, ids, want, strict=True):
        assert row["usage"]["prompt_tokens"] == len(prompt_ids)
        assert row["token_ids"] == want_ids, (row["prompt"], row["token_ids"], want_ids)
    events = [json.loads(line).get("event") for line in trace.read_text().splitlines()]
    assert "preempt" in events, "the KV cache was meant to force a preemption"


@pytest.fixture(scope="module")
def served(case: Case, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = case[0]  # --model DIR first (ServerProcess adds it), then --model-impl
    srv = ServerProcess(Path(flags[1]), *flags[2:], *TIGHT, "--served-model-name", "m",
                        log_dir=tmp_path_factory.mktemp("server"))
    yield from (ready.url for ready in srv.serve_module())


def test_server(case: Case, served: str, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    from actorllm.server.convert import TokenTexts

    _, _, ids, want = case
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pieces = TokenTexts(tok)  # how the server spells a token in its logprobs
    client = openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=300)
    completion = client.completions.create(
        model="m", prompt=ids, max_tokens=MAX_NEW, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True})
    choices = sorted(completion.choices, key=lambda c: c.index)
    assert len(choices) == len(ids)
    for choice, (want_ids, want_lps) in zip(choices, want, strict=True):
        # The API gives no ids: each token's text and logprob, and the whole text, must be
        # the oracle's.
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == [pieces.get(i)[0] for i in want_ids], choice.index
        assert choice.text == tok.decode(want_ids, skip_special_tokens=True)
        _close(list(choice.logprobs.token_logprobs), want_lps)
    status, _, body = http(served + "/metrics")
    assert status == 200
    counts = re.findall(r"^\S*num_preemptions_total(?:\{[^}]*\})? (\S+)$", body.decode(),
                        re.MULTILINE)
    assert counts and sum(float(c) for c in counts) > 0, "no preemption was forced"
