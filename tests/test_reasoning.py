"""Reasoning parsers, ``chat_template_kwargs`` and ``--chat-template`` (issue 31).

The parsers are checked on exact strings and, streamed in arbitrary chunkings
(hypothesis), must give what the whole text gives. End to end, the embedded model's
output is forced by a regex (structured output) into ``<think>...</think>`` and an
answer, and the server must hand the two back apart, whole and streamed, through the
official ``openai`` client; a template given with ``--chat-template`` reads
``enable_thinking`` from ``chat_template_kwargs``.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples
from test_server import ServerProcess, http

from actorllm.config import default_model_dir
from actorllm.server.reasoning import REASONING_PARSERS
from actorllm.text.hf import load_hf_tokenizer
from actorllm.wire.messages import StructuredOutput

EXACT = [
    ("qwen3", "<think>Let me see.</think>\n\nParis.", "Let me see.", "Paris."),
    ("qwen3", "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", "<think>cut off mid-thou", "cut off mid-thou", None),
    ("qwen3", "\n<think></think>Hi", "", "Hi"),
    ("qwen3", "a <think>late</think> b", None, "a <think>late</think> b"),
    ("deepseek_r1", "Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),
    ("deepseek_r1", "<think>Hmm.</think> 4", "Hmm.", "4"),
    ("deepseek_r1", "never closes", "never closes", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), EXACT)
def test_whole_text_splits(name: str, text: str, reasoning: str | None,
                           content: str | None) -> None:
    assert REASONING_PARSERS[name].split(text) == (reasoning, content)


def _streamed(name: str, pieces: list[str]) -> tuple[str, str]:
    stream = REASONING_PARSERS[name].stream()
    thought = answer = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        thought, answer = thought + r, answer + c
    return thought, answer


_ATOMS = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a",
                          "Paris", "<thi", "nk>", "/think>", "{}"])


@settings(max_examples=examples(400), deadline=None)
@given(atoms=st.lists(_ATOMS, max_size=12), cuts=st.lists(st.integers(0, 60), max_size=8),
       name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_any_chunking_gives_the_whole_split(atoms: list[str], cuts: list[int],
                                            name: str) -> None:
    text = "".join(atoms)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    reasoning, content = REASONING_PARSERS[name].split(text)
    assert _streamed(name, pieces) == (reasoning or "", content or "")


# (parser, constraint kind, spec, [(output, matches)]): every kind holds after the thinking.
AFTER = [
    ("qwen3", "json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                  "required": ["a"], "additionalProperties": False}),
     [('<think>maybe {"a": "x"}</think>\n{"a": 1}', True), ('{"a": 2}', True),
      ("<think>x</think>not json", False), ('{"a": "x"}', False)]),
    ("qwen3", "regex", "(yes|no)/[0-9]+",
     [("<think>maybe no</think>\n\nyes/12", True), ("no/3", True),
      ("<think>x</think>maybe", False), ("<think>x</think>", False), ("yes", False)]),
    ("qwen3", "choice", json.dumps(["yes", "no"]),
     [("<think>hm</think>\n\nno", True), ("yes", True), ("<think>hm</think>\nmaybe", False)]),
    # A Lark grammar whose rule names are the frame's own: the two do not clash.
    ("qwen3", "grammar", 'start: think body\nthink: "a"\nbody: "b"+',
     [("<think>t</think>\nabb", True), ("ab", True), ("<think>t</think>\nb", False),
      ("<think>a</think>", False)]),
    ("qwen3", "grammar", 'root ::= "x" [0-9]',
     [("<think>why</think>x1", True), ("x2", True), ("<think>why</think>y1", False)]),
    ("deepseek_r1", "choice", json.dumps(["yes", "no"]),
     [("hm</think>no", True), ("<think>hm</think> yes", True), ("no", True),
      ("hm</think>maybe", False)]),
]


@pytest.mark.parametrize(("name", "kind", "spec", "cases"), AFTER)
def test_every_constraint_holds_after_the_reasoning(
        name: str, kind: str, spec: str, cases: list[tuple[str, bool]]) -> None:
    import llguidance

    from actorllm.text.structured import LLGuidanceBackend, _grammar_text

    tok = load_hf_tokenizer(str(default_model_dir()))
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    wrapped = REASONING_PARSERS[name].wrap(StructuredOutput(kind, spec, "structured_outputs"))
    backend.check(wrapped)
    for text, ok in cases:
        matcher = llguidance.LLMatcher(backend._tokenizer(), _grammar_text(wrapped),
                                       log_level=0)
        consumed = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        assert bool(consumed and matcher.is_accepting()) == ok, text


def test_a_pattern_that_spells_out_the_reasoning_covers_the_whole_output() -> None:
    for pattern in (FORCED, "^" + FORCED):
        regex = StructuredOutput("regex", pattern, "structured_outputs")
        assert REASONING_PARSERS["qwen3"].wrap(regex) == regex


TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>"
            "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")
FORCED = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n\n(yes|no)"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("reasoning")
    (root / "t.jinja").write_text(TEMPLATE)
    srv = ServerProcess(Path(default_model_dir()), "--reasoning-parser", "qwen3",
                        "--chat-template", str(root / "t.jinja"), "--served-model-name", "m",
                        log_dir=root)
    yield from srv.serve_module()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_reasoning_comes_apart_whole_and_streamed(server: ServerProcess) -> None:
    client = _client(server)
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Sure?"}],
                          "max_tokens": 60, "temperature": 0,
                          "extra_body": {"structured_outputs": {"regex": FORCED}}}
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert isinstance(reasoning, str) and re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}", reasoning)
    assert message.content in ("yes", "no")
    thought = answer = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            answer += choice.delta.content or ""
    assert (thought, answer) == (reasoning, message.content)


@pytest.mark.parametrize("constraint", [
    {"regex": "(yes|no)"}, {"choice": ["yes", "no"]}, {"grammar": 'start: "yes" | "no"'}])
def test_the_reasoning_may_come_before_any_constraint(server: ServerProcess,
                                                      constraint: dict[str, Any]) -> None:
    client = _client(server)
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Sure?"}],
                          "temperature": 0, "extra_body": {"structured_outputs": constraint}}
    plain = client.chat.completions.create(max_tokens=10, **kw)
    assert plain.choices[0].message.content in ("yes", "no")
    # Pushed hard towards "<", the first token of "<think>": the constraint lets the
    # thinking open (before, it covered the whole output and "<" was masked).
    lt = load_hf_tokenizer(str(default_model_dir())).encode("<", add_special_tokens=False)
    assert len(lt) == 1
    forced = client.chat.completions.create(max_tokens=6, logit_bias={str(lt[0]): 100}, **kw)
    message = forced.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content")
    assert message.content is None and forced.choices[0].finish_reason == "length"


def test_template_file_and_its_kwargs(server: ServerProcess) -> None:
    client = _client(server)
    messages = [{"role": "user", "content": "Hi"}]

    def prompt_tokens(**extra: Any) -> int:
        out = client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                             extra_body=extra)
        assert out.usage is not None
        return out.usage.prompt_tokens

    def count(text: str) -> int:
        status, _, body = http(server.url + "/tokenize", "POST",
                               {"prompt": text, "add_special_tokens": False})
        assert status == 200
        return int(json.loads(body)["count"])

    plain = "<|user|>Hi\n<|assistant|>"
    assert prompt_tokens() == count(plain)  # rendered by the --chat-template file
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == \
        count(plain + "<think>\n\n</think>\n\n")
    for refused in ({"tokenize": False}, {"enable_thinking": False, "x": 1}):
        with pytest.raises(openai.BadRequestError) as err:  # reserved, or not read: no-op
            prompt_tokens(chat_template_kwargs=refused)
        assert "chat_template_kwargs" in str(err.value)
