"""One ModelInfo: the context limit, the EOS ids and the sampling defaults, read once.

Before issue 12 the Tokenizer, the Worker, the CLI and the server each read some of these
facts themselves and disagreed: a Mistral-style sliding window below the position limit
let the Tokenizer accept a prompt the Worker then refused (failing every sequence of the
step), and the Worker's EOS ids added config.json's to generation_config.json's where
transformers replaces them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import trio
from helpers import build_tiny_model
from transformers import GenerationConfig

from actorllm.config import (
    EngineConfig,
    eos_ids,
    model_context_limit,
    read_model_info,
    sampling_defaults,
)
from actorllm.engine.async_engine import Resources, open_engine
from actorllm.llm import collect
from actorllm.server.convert import sampling_params as http_sampling_params
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.tokenizer.actor import PromptEncoder
from actorllm.wire.messages import GenerateRequest, SamplingParams


@pytest.mark.parametrize(("cfg", "limit"), [
    ({"max_position_embeddings": 64}, 64),
    # Windows are the attention op's work, so a windowed model serves all its positions.
    ({"max_position_embeddings": 64, "sliding_window": 32}, 64),  # Mistral-7B-v0.1's shape
    ({"max_position_embeddings": 64, "sliding_window": None}, 64),
    ({"max_position_embeddings": 64, "sliding_window": 128}, 64),
    # Qwen2 writes a window and turns it off.
    ({"max_position_embeddings": 64, "sliding_window": 32, "use_sliding_window": False}, 64),
    ({"max_position_embeddings": 64, "sliding_window": 32,
      "layer_types": ["full_attention", "full_attention"]}, 64),
    ({"max_position_embeddings": 64, "sliding_window": 32,
      "layer_types": ["full_attention", "sliding_attention"]}, 64),
])
def test_context_limit_is_the_position_limit_window_or_not(cfg: dict[str, object],
                                                           limit: int) -> None:
    assert model_context_limit(cfg) == limit


@pytest.mark.parametrize(("gen", "cfg"), [
    ({"eos_token_id": [1]}, {"eos_token_id": 7}),
    ({"eos_token_id": 3}, {"eos_token_id": [7, 8]}),
    ({}, {"eos_token_id": [7, 8]}),
    ({"bos_token_id": 0}, {"eos_token_id": 7}),
])
def test_eos_ids_are_the_ones_transformers_generate_uses(tmp_path: Path, gen: dict[str, object],
                                                        cfg: dict[str, object]) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    hf = GenerationConfig.from_pretrained(str(tmp_path)).eos_token_id
    expected = cfg["eos_token_id"] if hf is None else hf  # no eos in the file: the model's
    expected = tuple(expected) if isinstance(expected, list) else (expected,)
    assert eos_ids(gen, cfg) == expected


def _tiny(tmp_path: Path, tokenizer_dir: Path, family: str, gen: dict[str, object] | None = None,
          **overrides: object) -> Path:
    model = build_tiny_model(tmp_path / family, family, tokenizer_dir=tokenizer_dir, **overrides)
    if gen is not None:
        (model / "generation_config.json").write_text(json.dumps(gen))
    return model


async def test_a_prompt_past_the_window_is_refused_alone(tmp_path: Path,
                                                         tokenizer_dir: Path) -> None:
    """The Tokenizer refuses what the Worker would; the step's other sequence is unharmed.

    The limit is the position limit (64), not the window (32): windows are the attention
    op's work."""
    model = _tiny(tmp_path, tokenizer_dir, "mistral", max_position_embeddings=64,
                  sliding_window=32)
    config = EngineConfig(model=str(model), num_kv_blocks=48, block_size=4)
    res = Resources(config)
    assert res.info.max_model_len == res.runner.max_model_len == 64
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with open_engine(config, resources=res) as engine:
        results = {}

        async def one(name: str, ids: list[int]) -> None:
            results[name] = await collect(engine, name, ids, greedy)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "windowed", [5] * 40)  # past the window, within 64
            nursery.start_soon(one, "long", [5] * 70)  # past the 64 positions
            nursery.start_soon(one, "short", [5, 6, 7])
        assert await engine.wait_drained() == []
    long, short = results["long"], results["short"]
    assert long.error is not None and "maximum context length is 64" in long.error, long
    assert short.error is None and len(short.outputs[0].token_ids) == 4, short
    windowed = results["windowed"]
    assert windowed.error is None and len(windowed.outputs[0].token_ids) == 4, windowed


async def test_worker_and_scheduler_agree_on_eos(tmp_path: Path, tokenizer_dir: Path) -> None:
    """config.json's eos (7) is not an EOS when generation_config.json names its own (1).

    With min_tokens the sampler suppresses EOS; a Worker that took 7 for EOS would refuse
    the token the logit bias forces.
    """
    model = _tiny(tmp_path, tokenizer_dir, "llama", gen={"eos_token_id": [1]}, eos_token_id=7)
    config = EngineConfig(model=str(model), num_kv_blocks=32, block_size=4, max_model_len=64)
    res = Resources(config)
    assert res.info.eos_token_ids == res.runner.eos_token_ids == (1,)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, logit_bias=((7, 100.0),))
    async with open_engine(config, resources=res) as engine:
        out = await collect(engine, "r", [5, 6], params)
        assert await engine.wait_drained() == []
    assert list(out.outputs[0].token_ids) == [7, 7, 7, 7]
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("gen", [
    {},
    {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "max_new_tokens": 20},
    {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.2},
    {"min_p": 0.1},
])
def test_cli_and_http_take_the_same_defaults(gen: dict[str, object]) -> None:
    from actorllm.cli import build_parser
    from actorllm.cli import sampling_params as cli_sampling_params

    defaults = sampling_defaults(gen)
    args = build_parser().parse_args(["run", "a prompt"])
    assert isinstance(args, argparse.Namespace)
    cli = cli_sampling_params(args, defaults)
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    http = http_sampling_params(body, defaults=defaults, vocab_size=400)
    for field in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert getattr(cli, field) == getattr(http, field), field
    # transformers' do_sample: false is greedy, whatever temperature the file also names.
    assert (cli.temperature == 0.0) == (gen.get("do_sample") is False)
    # A length the model names is left for the Tokenizer to cap by the context.
    assert http.max_tokens is None
    assert cli.max_tokens == (None if "max_new_tokens" in gen else 64)


def test_the_models_max_new_tokens_is_capped_by_the_context(tmp_path: Path,
                                                            tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    model = _tiny(tmp_path, tokenizer_dir, "llama", gen={"eos_token_id": 1, "max_new_tokens": 20},
                  max_position_embeddings=32)
    info = read_model_info(model)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(model)), info)
    unset = SamplingParams(max_tokens=None)
    assert encoder.encode(GenerateRequest("a", unset, prompt_token_ids=(5,) * 4)).max_tokens == 20
    # 28 tokens leave room for 4: the default shrinks rather than failing the request.
    assert encoder.encode(GenerateRequest("b", unset, prompt_token_ids=(5,) * 28)).max_tokens == 4
    given = SamplingParams(max_tokens=10)
    with pytest.raises(Exception, match="maximum context length"):
        encoder.encode(GenerateRequest("c", given, prompt_token_ids=(5,) * 28))
