"""``POST /v1/embeddings`` against transformers' own hidden states (issue 31).

The server runs the embedded model in float32 with a small token budget, so a long
prompt is prefilled in several chunks (the mean must span them) and the prefix cache is
on (a repeated prompt must still pool every position). Each pooled vector must match
transformers' last hidden state, pooled and normalized the same way, to a cosine of
0.9999 or better.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from helpers import hf_model
from test_server import ServerProcess, http

from actorllm.config import default_model_dir
from actorllm.text.hf import load_hf_tokenizer

MODEL = Path(default_model_dir())
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Embeddings pool the final hidden states. " * 6, "hi"]


@pytest.fixture(scope="module", params=["last", "mean"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, openai.OpenAI, str]]:
    srv = ServerProcess(MODEL, "--pooling", request.param, "--dtype", "float32",
                        "--max-num-batched-tokens", "32", "--enable-prefix-caching",
                        "--served-model-name", "m",
                        log_dir=tmp_path_factory.mktemp(f"emb-{request.param}"))
    for ready in srv.serve_module():
        yield request.param, openai.OpenAI(base_url=ready.url + "/v1", api_key="x",
                                           max_retries=0, timeout=120), ready.url


@pytest.fixture(scope="module")
def oracle() -> Any:
    return hf_model(MODEL), load_hf_tokenizer(str(MODEL))


def _expected(oracle: Any, ids: list[int], pooling: str,
              normalize: bool = True) -> torch.Tensor:
    model, _ = oracle
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    last = out.hidden_states[-1][0]
    vec = {"last": last[-1], "mean": last.mean(dim=0), "cls": last[0]}[pooling]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def _cos(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


def test_strings_match_transformers(served: tuple[str, openai.OpenAI, str],
                                    oracle: Any) -> None:
    pooling, client, _ = served
    _, tok = oracle
    resp = client.embeddings.create(model="m", input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    ids = [tok(t).input_ids for t in TEXTS]
    assert len(ids[1]) > 64  # prefilled in several chunks of at most 32 tokens
    for d, want in zip(resp.data, ids, strict=True):
        assert abs(sum(v * v for v in d.embedding) - 1.0) < 1e-4
        assert _cos(d.embedding, _expected(oracle, want, pooling)) >= 0.9999
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids) == resp.usage.total_tokens
    # Again: the prompts' blocks are in the prefix cache now, and the result is the same.
    again = client.embeddings.create(model="m", input=TEXTS[1])
    assert _cos(again.data[0].embedding, _expected(oracle, ids[1], pooling)) >= 0.9999


def test_token_ids_and_base64(served: tuple[str, openai.OpenAI, str], oracle: Any) -> None:
    pooling, client, url = served
    ids = [[5, 17, 99, 3], [42] * 40]
    resp = client.embeddings.create(model="m", input=ids, encoding_format="float")
    for d, want in zip(resp.data, ids, strict=True):
        assert _cos(d.embedding, _expected(oracle, want, pooling)) >= 0.9999
    status, _, body = http(url + "/v1/embeddings", "POST",
                           {"input": ids[0], "encoding_format": "base64"})
    assert status == 200
    raw = base64.b64decode(json.loads(body)["data"][0]["embedding"])
    floats = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert _cos(floats, _expected(oracle, ids[0], pooling)) >= 0.9999


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_llm_embed_matches_transformers(oracle: Any, pooling: str) -> None:
    """vLLM's offline ``LLM.embed``: the vectors ``/v1/embeddings`` gives, from text and
    ids, chunked over several steps; a pooling it does not know is refused by name."""
    from actorllm.llm import LLM

    _, tok = oracle
    with LLM(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=256) as llm:
        got = llm.embed([*TEXTS, [5, 17, 99, 3]], pooling=pooling)
        with pytest.raises(ValueError, match="pooling 'max'"):
            llm.embed("x", pooling="max")
        (cut,) = llm.embed(TEXTS[1], pooling=pooling, truncate_prompt_tokens=10)
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or at least 1"):
            llm.embed("x", truncate_prompt_tokens=0)
    ids = [tok(t).input_ids for t in TEXTS] + [[5, 17, 99, 3]]
    assert cut.prompt_token_ids == tuple(ids[1][-10:])
    assert _cos(cut.outputs.embedding, _expected(oracle, ids[1][-10:], pooling)) >= 0.9999
    for res, want in zip(got, ids, strict=True):
        assert res.error is None and res.prompt_token_ids == tuple(want)
        assert abs(sum(v * v for v in res.outputs.embedding) - 1.0) < 1e-4
        assert _cos(res.outputs.embedding, _expected(oracle, want, pooling)) >= 0.9999


def test_truncate_prompt_tokens_pools_the_last_k(served: tuple[str, openai.OpenAI, str],
                                                 oracle: Any) -> None:
    """vLLM's ``truncate_prompt_tokens`` on /v1/embeddings: each input, text or ids, is
    pooled over its last k tokens only, and usage counts those."""
    pooling, client, _ = served
    _, tok = oracle
    ids = tok(TEXTS[1]).input_ids
    for given in (TEXTS[1], ids):
        resp = client.embeddings.create(model="m", input=given,
                                        extra_body={"truncate_prompt_tokens": 10})
        assert _cos(resp.data[0].embedding, _expected(oracle, ids[-10:], pooling)) >= 0.9999
        assert resp.usage.prompt_tokens == 10


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": [[1, 2], []]}, "input"), ({"input": "x", "model": "other"}, "model"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens")])
def test_bad_requests_name_the_field(served: tuple[str, openai.OpenAI, str],
                                     body: dict[str, Any], param: str) -> None:
    _, _, url = served
    status, _, raw = http(url + "/v1/embeddings", "POST", body)
    assert status in (400, 404), raw
    assert param in raw.decode()


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_runner_pools_both_model_impls(oracle: Any, impl: str) -> None:
    """The native model leaves the final norm to compute_logits, the transformers path
    applies it in forward: pooled through either, a prompt split over two steps gives
    transformers' own final hidden state."""
    from actorllm.wire.messages import NewSeqData, SamplingParams, ScheduledSeq, StepPlan
    from actorllm.worker.runner import ModelRunner

    _, tok = oracle
    ids = tok(TEXTS[1]).input_ids
    runner = ModelRunner(MODEL, num_blocks=32, block_size=16, dtype=torch.float32,
                         model_impl=impl)
    try:
        table = tuple(range(-(-len(ids) // 16)))
        half = len(ids) // 2
        for step, pooling in enumerate(("last", "mean", "cls")):
            rid = f"r-{pooling}"
            new = NewSeqData(SamplingParams(max_tokens=0, pooling=pooling), tuple(ids))
            first = runner.execute(StepPlan.of_rows(2 * step, (
                ScheduledSeq(rid, tuple(ids[:half]), 0, table, False, new),)))
            assert first.error is None and first.pooled == ()
            second = runner.execute(StepPlan.of_rows(2 * step + 1, (
                ScheduledSeq(rid, tuple(ids[half:]), half, (), False),), drop=(rid,)))
            assert second.error is None
            (got,) = second.pooled
            assert got.rid == rid
            assert _cos(list(got.values), _expected(oracle, ids, pooling)) > 0.9999
    finally:
        runner.close()


def _sentence_transformers_dir(root: Path, pooling: dict[str, Any], normalize: bool) -> Path:
    """The embedded model laid out as sentence-transformers lays a model out."""
    root.mkdir(exist_ok=True)
    for file in MODEL.iterdir():
        (root / file.name).symlink_to(file)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False}
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 256, **modes, **pooling, "include_prompt": True}))
    return root


# (the Pooling module's modes, a Normalize module, flags, the pooling and normalizing expected)
ST_LAYOUTS = [({"pooling_mode_cls_token": True}, True, (), "cls", True),
              ({"pooling_mode_mean_tokens": True}, False, (), "mean", False),
              ({"pooling_mode_cls_token": True}, False, ("--pooling", "last"), "last", False)]


@pytest.mark.parametrize(("modes", "normalize", "flags", "pooling", "normed"), ST_LAYOUTS)
def test_sentence_transformers_config_chooses_the_pooling(
        tmp_path: Path, oracle: Any, modes: dict[str, Any], normalize: bool,
        flags: tuple[str, ...], pooling: str, normed: bool) -> None:
    model_dir = _sentence_transformers_dir(tmp_path / "st", modes, normalize)
    srv = ServerProcess(model_dir, *flags, "--dtype", "float32",
                        "--max-num-batched-tokens", "32", "--enable-prefix-caching",
                        "--served-model-name", "m", log_dir=tmp_path)
    _, tok = oracle
    for ready in srv.serve_module():
        client = openai.OpenAI(base_url=ready.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        resp = client.embeddings.create(model="m", input=TEXTS[:2])
        # Again: the prompt's blocks are cached now, and its first position still pooled.
        again = client.embeddings.create(model="m", input=TEXTS[1])
        for d, text in zip([*resp.data, *again.data], [*TEXTS[:2], TEXTS[1]], strict=True):
            want = _expected(oracle, tok(text).input_ids, pooling, normalize=normed)
            assert _cos(d.embedding, want) >= 0.9999
            norm = sum(v * v for v in d.embedding) ** 0.5
            assert abs(norm - float(want.norm())) <= 1e-3 * float(want.norm())


def test_unsupported_sentence_transformers_pooling_is_named(tmp_path: Path) -> None:
    from actorllm.server.features import Features, sentence_transformers_pooling

    model_dir = _sentence_transformers_dir(tmp_path, {"pooling_mode_max_tokens": True}, True)
    found = sentence_transformers_pooling(model_dir)
    with pytest.raises(ValueError, match=r"max_tokens.*--pooling"):
        Features.build(model_pooling=found)
    assert Features.build(pooling="mean", model_pooling=found).pooling == "mean"
    assert sentence_transformers_pooling(MODEL) is None  # no modules.json: the flag's default
