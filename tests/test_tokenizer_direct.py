"""Short inputs are encoded by ``tokenizers.Tokenizer.encode`` (which keeps the GIL) only
where it gives transformers' ids (``tokenizer/direct.py``): checked here on the tiny test
tokenizer and the embedded model's, with a tokenizer that disagrees falling back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from actorllm.config import read_model_info
from actorllm.tokenizer.actor import PromptEncoder
from actorllm.tokenizer.direct import DirectEncoder
from actorllm.wire.messages import ChatMessage, GenerateRequest, SamplingParams

EMBEDDED = Path(__file__).resolve().parent.parent / "actorllm" / "assets" / "default-model"
TEXTS = ["plain words", "  spaced\n\nlines\t", "ünïcödé 東京 🙂", "<|bos|>inside<|eos|> x",
         "1234567890" * 20, ""]


def _hf_ids(tok: Any, text: str, special: bool) -> list[int]:
    return [int(t) for t in tok(text, add_special_tokens=special).input_ids]


def _hf_chat(tok: Any, convo: list[dict[str, str]], gen: bool) -> list[int]:
    out = tok.apply_chat_template(convo, add_generation_prompt=gen, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


@pytest.fixture(scope="module")
def embedded() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(EMBEDDED))


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_direct_ids_are_transformers_ids(which: str, tiny_tokenizer: PreTrainedTokenizerBase,
                                         embedded: PreTrainedTokenizerBase):
    tok = tiny_tokenizer if which == "tiny" else embedded
    direct = DirectEncoder(tok, max_chars=4096)
    assert direct.backend is not None  # both are fast tokenizers that agree
    for text in TEXTS:
        for special in (True, False):
            assert direct.text(text, special) == _hf_ids(tok, text, special), text
    if direct.chat_ok:
        for convo in ([{"role": "user", "content": t}] for t in TEXTS):
            for gen in (True, False):
                assert direct.chat(convo, gen) == _hf_chat(tok, convo, gen)


def test_the_embedded_models_chat_goes_direct(embedded: PreTrainedTokenizerBase):
    assert DirectEncoder(embedded, max_chars=4096).chat_ok


class _Disagrees:
    """A fast tokenizer's stand-in whose backend adds an id transformers does not."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.chat_template = tok, getattr(tok, "chat_template", None)
        self.all_special_tokens = tok.all_special_tokens
        outer = tok.backend_tokenizer

        class Backend:
            def encode(self, text: str, add_special_tokens: bool = True) -> Any:
                enc = outer.encode(text, add_special_tokens=add_special_tokens)
                return type("E", (), {"ids": [*enc.ids, 3]})()

        self.backend_tokenizer = Backend()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tok(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tok.apply_chat_template(*args, **kwargs)


def test_a_backend_that_disagrees_is_not_used(embedded: PreTrainedTokenizerBase):
    stand_in = _Disagrees(embedded)
    direct = DirectEncoder(stand_in, max_chars=4096)
    assert direct.backend is None and not direct.chat_ok
    assert direct.text("anything", True) is None
    enc = PromptEncoder(stand_in, read_model_info(str(EMBEDDED)))
    got = enc.encode(GenerateRequest("r", SamplingParams(max_tokens=4), prompt="some words"))
    assert list(got.prompt_token_ids) == _hf_ids(embedded, "some words", True)


def test_long_inputs_keep_transformers_path(embedded: PreTrainedTokenizerBase):
    """Past ``max_chars`` encoding runs where releasing the GIL is the point (a thread)."""
    direct = DirectEncoder(embedded, max_chars=64)
    assert direct.text("short", True) is not None
    assert direct.text("x" * 65, True) is None
    assert direct.chat([{"role": "user", "content": "y" * 80}], True) is None
    enc = PromptEncoder(embedded, read_model_info(str(EMBEDDED)))
    enc.direct = direct
    long_text = "z w " * 40
    for req in (GenerateRequest("a", SamplingParams(max_tokens=4), prompt=long_text),
                GenerateRequest("b", SamplingParams(max_tokens=4),
                                messages=(ChatMessage("user", long_text, None),))):
        want = (_hf_ids(embedded, long_text, True) if req.prompt is not None else
                _hf_chat(embedded, [{"role": "user", "content": long_text}], True))
        assert list(enc.encode(req).prompt_token_ids) == want
