"""The server as lm-evaluation-harness's ``local-completions`` model drives it (issue 18).

For a loglikelihood request the harness posts token-id prompts (context + continuation)
in a batch to ``/v1/completions`` with ``echo: true, logprobs: 1, max_tokens: 1,
temperature: 0`` and reads the continuation's score from the echoed prompt's
``token_logprobs[ctxlen:-1]`` (the last entry is the generated token). The client side
below follows the harness step by step (pair encoding, truncation to ``max_length``,
rolling windows for perplexity); the oracle is transformers on the same token ids.

One server (``actorllm serve`` in a subprocess, the embedded default model) is shared by
the module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_server import ServerProcess, http
from transformers import PreTrainedTokenizerBase

MODEL_DIR = Path(__file__).resolve().parent.parent / "actorllm" / "assets" / "default-model"
MODEL = "default"
# The model's context is 512 and the harness asks for one generated token on top of the
# prompt, so its `max_length` must leave room for it.
MAX_LENGTH = 511


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = ServerProcess(MODEL_DIR, "--served-model-name", MODEL,
                        log_dir=tmp_path_factory.mktemp("lm-eval-server"))
    try:
        yield srv.wait_ready()
    finally:
        rc = srv.stop()
    assert rc == 0, srv.stderr()


# --- the harness's client side ----------------------------------------------------------


def encode_pair(tok: PreTrainedTokenizerBase, context: str,
                continuation: str) -> tuple[list[int], list[int]]:
    """The harness's pair encoding: trailing spaces move to the continuation, no BOS."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    context_ids = tok(context, add_special_tokens=False).input_ids if context else \
        [tok.bos_token_id]  # an empty context is the prefix token
    return context_ids, whole[len(context_ids):]


def loglikelihoods(base: str, requests: list[tuple[list[int], list[int]]]
                   ) -> list[tuple[float, bool]]:
    """One batched POST, parsed as the harness parses it: (sum of logprobs, is greedy)."""
    prompts, ctxlens = [], []
    for context, continuation in requests:
        prompts.append((context + continuation)[-MAX_LENGTH:])
        ctxlens.append(len(context) - max(0, len(context) + len(continuation) - MAX_LENGTH))
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    status, _, raw = http(base + "/v1/completions", "POST", body)
    assert status == 200, raw
    out = []
    choices = sorted(json.loads(raw)["choices"], key=lambda c: c["index"])
    for choice, ctxlen, prompt in zip(choices, ctxlens, prompts, strict=True):
        assert ctxlen > 0
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(prompt) + 1  # the prompt, then 1 token
        scores = lps["token_logprobs"][ctxlen:-1]
        tops = lps["top_logprobs"][ctxlen:-1]
        greedy = all(s == max(top.values()) for s, top in zip(scores, tops, strict=True))
        out.append((sum(scores), greedy))
    return out


def rolling_windows(tokens: list[int], prefix: int, max_seq_len: int
                    ) -> list[tuple[list[int], list[int]]]:
    """The harness's disjoint rolling windows (context length 1): every token predicted
    once, each window conditioned on up to ``max_seq_len`` tokens before it."""
    windows = [([prefix], tokens[:max_seq_len])]
    done = len(windows[0][1])
    while done < len(tokens):
        n = min(len(tokens) - done, max_seq_len)
        end = done + n
        context = tokens[max(end - max_seq_len - 1, 0): end - 1]
        windows.append((context[: len(context) - (n - 1)], tokens[end - n: end]))
        done = end
    return windows


# --- the oracle -----------------------------------------------------------------------


def hf_loglikelihood(hf: Any, context: list[int], continuation: list[int]
                     ) -> tuple[float, bool]:
    ids = (context + continuation)[-MAX_LENGTH:]
    ctxlen = len(ids) - len(continuation)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    rows = lp[ctxlen - 1: len(ids) - 1]
    target = torch.tensor(ids[ctxlen:])
    score = rows.gather(1, target[:, None]).sum().item()
    return score, bool((rows.argmax(-1) == target).all())


# --- tests ----------------------------------------------------------------------------


def test_loglikelihood_of_multiple_choice_continuations(base: str, default_tokenizer: Any,
                                                        default_hf: Any) -> None:
    context = "Return a new list containing all items from the iterable in ascending "
    choices = ["order.", "colour.", "time.", "orderly fashion."]
    requests = [encode_pair(default_tokenizer, context, c) for c in choices]
    requests.append(encode_pair(default_tokenizer, "", "The os module provides"))
    got = loglikelihoods(base, requests)
    want = [hf_loglikelihood(default_hf, c, x) for c, x in requests]
    for (score, greedy), (ref, ref_greedy), (_, cont) in zip(got, want, requests, strict=True):
        assert score == pytest.approx(ref, abs=1e-4 * len(cont)), (score, ref)
        assert greedy == ref_greedy
    # What the harness would conclude: the same answer as transformers.
    best = max(range(len(choices)), key=lambda i: got[i][0])
    assert best == max(range(len(choices)), key=lambda i: want[i][0])


def test_rolling_perplexity_of_the_held_out_text_matches_the_model_card(
        base: str, default_tokenizer: Any, default_hf: Any) -> None:
    text = (MODEL_DIR / "heldout_sample.txt").read_text(encoding="utf-8")
    tokens = default_tokenizer(text, add_special_tokens=False).input_ids
    windows = rolling_windows(tokens, default_tokenizer.bos_token_id, MAX_LENGTH - 1)
    assert len(windows) > 2 and sum(len(w[1]) for w in windows) == len(tokens)
    got = loglikelihoods(base, windows)
    nll = -sum(score for score, _ in got) / len(tokens)
    ref = -sum(hf_loglikelihood(default_hf, c, x)[0] for c, x in windows) / len(tokens)
    assert nll == pytest.approx(ref, abs=1e-4)
    card = (MODEL_DIR / "MODEL_CARD.md").read_text(encoding="utf-8")
    val_loss = float(re.search(r"^val_loss: (\S+)$", card, flags=re.MULTILINE).group(1))
    # The card's figure is over the whole validation split, the sample is a few KB of it
    # (the same tolerance as tests/test_default_model.py).
    assert abs(nll - val_loss) < 0.25, (nll, val_loss, math.exp(nll))
