"""Tests for the embedded default model in ``actorllm/assets/default-model``.

The model's files and quality are checked with transformers; actorllm's engine on it is
checked against transformers' greedy ``generate``, token for token (prompts as text, as
token ids and as a chat, several in one batch).

The model is built by ``scripts/train_default_model.py``.  Held-out text: that script writes
``heldout_sample.txt``, a few KB of validation docstrings (whole documents excluded from
training, chosen with the card's seed), into the model directory; the baseline below is a
unigram model estimated from different text, the ``pydoc_data`` topic pages.
"""

from __future__ import annotations

import collections
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import trio

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parent.parent / "actorllm" / "assets" / "default-model"
MAX_BYTES = 25 * 1024 * 1024
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything must load without a model hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def card() -> dict[str, str]:
    """The key: value lines of the card's machine-readable block."""
    text = (MODEL_DIR / "MODEL_CARD.md").read_text(encoding="utf-8")
    block = text.split("## Machine-readable summary", 1)[1]
    return dict(re.findall(r"^(\w+): (\S+)$", block, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    m.eval()
    return m


def test_shipped_files_exist() -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "MODEL_CARD.md", "heldout_sample.txt"):
        assert (MODEL_DIR / name).is_file(), name
    tok_cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["chat_template"]


def test_config(model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.max_position_embeddings >= 512
    assert config.bos_token_id == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids(
        "<|bos|>")
    assert config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(
        "<|eos|>")
    assert config.vocab_size == len(tokenizer)


def test_card_matches_files(model: torch.nn.Module, card: dict[str, str]) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    assert int(card["parameters"]) == n_params
    files = [p for p in MODEL_DIR.iterdir() if p.is_file()]
    payload = sum(p.stat().st_size for p in files if p.name != "MODEL_CARD.md")
    assert int(card["size_bytes"]) == payload  # card: every file except the card itself
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES
    assert math.isclose(math.exp(float(card["val_loss"])), float(card["val_ppl"]), rel_tol=1e-2)


def test_tokenizer_round_trip(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    text = "def f(x):\n    return {'a': x}  # naïve, 100%\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer(text).input_ids[0] == tokenizer.bos_token_id


def test_chat_template(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What does json.dumps do?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|>")
    assert "<|system|>\nBe brief.<|end|>" in text
    assert "<|user|>\nWhat does json.dumps do?<|end|>" in text
    assert text.endswith("<|assistant|>\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    for token in ("<|bos|>", *ROLE_TOKENS[:3]):
        assert tokenizer.convert_tokens_to_ids(token) in ids
    assert ids[-2:] == tokenizer("<|assistant|>\n", add_special_tokens=False).input_ids


def heldout_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> list[int]:
    heldout = (MODEL_DIR / "heldout_sample.txt").read_text(encoding="utf-8")
    ids = tokenizer(heldout).input_ids
    assert len(ids) > 500
    return ids


def model_nll(model: torch.nn.Module, ids: list[int]) -> float:
    """Mean next-token loss (nats) of the model on ids, in context-sized chunks."""
    ctx = model.config.max_position_embeddings
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, ctx):
            chunk = torch.tensor([ids[start: start + ctx]])
            if chunk.shape[1] < 2:
                break
            loss = model(input_ids=chunk, labels=chunk).loss.item()
            nll += loss * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    return nll / count


def test_card_validation_loss_is_the_models(
    model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase,
    card: dict[str, str],
) -> None:
    # The card's figure is over the whole validation split; the shipped sample is a few KB of
    # it, so they agree only roughly - but a card left over from another checkpoint would not.
    sample_loss = model_nll(model, heldout_ids(tokenizer))
    assert abs(sample_loss - float(card["val_loss"])) < 0.25, (sample_loss, card["val_loss"])


def test_beats_unigram_baseline(
    model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    ids = heldout_ids(tokenizer)
    model_ppl = math.exp(model_nll(model, ids))

    # Unigram baseline from different text (the pydoc topic pages), add-one smoothing.
    from pydoc_data.topics import topics

    counts = collections.Counter()
    for page in topics.values():
        counts.update(tokenizer(page, add_special_tokens=False).input_ids)
    total, vocab = sum(counts.values()), len(tokenizer)
    unigram_nll = -sum(math.log((counts[i] + 1) / (total + vocab)) for i in ids[1:])
    unigram_ppl = math.exp(unigram_nll / (len(ids) - 1))

    assert model_ppl < 0.5 * unigram_ppl, (model_ppl, unigram_ppl)


def test_generates_text(model: torch.nn.Module,
                        tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    ids = tokenizer("Return a new list", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                         do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) > 5


PARITY_PROMPTS = ["Return a new list", "def load(path):", "The json module",
                  "Raise ValueError if"]


def _hf_greedy(model: torch.nn.Module, ids: list[int], max_new: int,
               repetition_penalty: float) -> list[int]:
    """transformers' greedy continuation, eos ignored; the checkpoint's generation config
    sets a repetition penalty, so it is named here rather than taken from there."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                            dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, eos_token_id=None,
                             pad_token_id=model.config.eos_token_id,
                             repetition_penalty=repetition_penalty)
    return out[0, len(ids):].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("penalty", [1.0, 1.2])  # plain greedy, and the model's default
async def test_actorllm_generates_what_transformers_does_greedily(
        model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase,
        penalty: float) -> None:
    from actorllm.config import EngineConfig, default_model_dir
    from actorllm.engine.async_engine import Resources, open_engine
    from actorllm.llm import collect
    from actorllm.wire.messages import ChatMessage, SamplingParams

    assert default_model_dir().resolve() == MODEL_DIR.resolve()
    max_new = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                            repetition_penalty=penalty)
    chat = [ChatMessage("user", "What does json.dumps do?")]
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    cases: list[tuple[Any, list[int]]] = [
        *((p, tokenizer(p).input_ids) for p in PARITY_PROMPTS),  # actorllm tokenizes
        (tokenizer("Parse a").input_ids, tokenizer("Parse a").input_ids),  # ids as given
        (chat, list(chat_ids)),  # actorllm renders the chat template
    ]
    resources = Resources(EngineConfig(model=str(default_model_dir()), num_kv_blocks=128))
    results: dict[int, Any] = {}
    async with open_engine(resources.config, resources=resources) as engine:

        async def one(i: int, prompt: Any) -> None:
            results[i] = await collect(engine, f"parity{i}", prompt, params)

        async with trio.open_nursery() as nursery:  # one batch, not one at a time
            for i, (prompt, _) in enumerate(cases):
                nursery.start_soon(one, i, prompt)
    for i, (prompt, ids) in enumerate(cases):
        res = results[i]
        assert res.error is None, (prompt, res.error)
        assert res.num_prompt_tokens == len(ids), prompt
        (out,) = res.outputs
        ref_ids = _hf_greedy(model, ids, max_new, penalty)
        assert list(out.token_ids) == ref_ids, prompt
        assert out.text == tokenizer.decode(ref_ids, skip_special_tokens=True), prompt
