"""``LLM``'s vLLM-shaped calls. ``chat``: conversations rendered by the model's chat
template, checked as the HTTP server checks messages; greedy output equals transformers'
on the same ids. ``generate(use_tqdm=True)``: a progress bar on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import hf_greedy

from actorllm.llm import LLM
from actorllm.wire.messages import ChatMessage, SamplingParams

TALK = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where does the river run?"}]
N = 8


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> Any:
    with LLM(model=str(tiny_llama_dir), num_kv_blocks=64) as llm:
        yield llm


def template_ids(llm: LLM, messages: list[dict[str, Any]], gen: bool = True) -> list[int]:
    out = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=gen,
                                            tokenize=True, return_dict=False)
    return list(out)


def test_chat_matches_transformers_on_the_templated_prompt(llm: LLM,
                                                           tiny_llama_dir: Path) -> None:
    (res,) = llm.chat(TALK, greedy())
    ids = template_ids(llm, TALK)
    assert res.error is None and res.num_prompt_tokens == len(ids)
    assert list(res.outputs[0].token_ids) == hf_greedy(tiny_llama_dir, ids, N)[0]


def test_a_list_of_conversations_and_every_form_of_message(llm: LLM) -> None:
    parts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Where does the "},
                                          {"type": "text", "text": "river run?"}]}]
    objects = [ChatMessage("system", "Be brief."),
               ChatMessage("user", "Where does the river run?")]
    other = [{"role": "user", "content": "Hello"}]
    a, b, c, d = llm.chat([TALK, parts, objects, other], greedy())
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert d.num_prompt_tokens == len(template_ids(llm, other))


def test_add_generation_prompt_is_honoured(llm: LLM) -> None:
    (res,) = llm.chat(TALK, greedy(), add_generation_prompt=False)
    assert res.num_prompt_tokens == len(template_ids(llm, TALK, gen=False))
    assert res.num_prompt_tokens < len(template_ids(llm, TALK))


@pytest.mark.parametrize(("messages", "kwargs", "match"), [
    ([], {}, r"^messages must not be empty$"),
    ({"role": "user", "content": "hi"}, {}, r"^messages is a list of messages"),
    ([[]], {}, r"^a conversation is a non-empty list of messages$"),
    ([{"role": "robot", "content": "hi"}], {}, r"^messages\[0\]\.role: "),
    ([{"content": "hi"}], {}, r"^messages\[0\]\.role: Field required"),
    ([{"role": "user", "content": "hi", "temperature": 1}], {},
     r"^messages\[0\]\.temperature: "),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], {},
     r"^messages\[1\]: a tool message needs tool_call_id$"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     r"^messages\[0\]"),
    (TALK, {"chat_template_kwargs": {"enable_thinking": True}},
     r"^chat_template_kwargs: the chat template does not read enable_thinking$"),
])
def test_a_bad_conversation_is_refused_by_name(llm: LLM, messages: Any, kwargs: Any,
                                               match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, greedy(), **kwargs)


PROGRESS = """
import sys
from actorllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], num_kv_blocks=64)
done = []
params = SamplingParams(temperature=0.0, max_tokens=4)
out = llm.generate(["a b", "c d"], params, use_tqdm=True, on_done=done.append)
out += llm.chat([{"role": "user", "content": "e f"}], params, use_tqdm=True,
                on_done=done.append)
assert sorted(r.rid for r in done) == sorted(r.rid for r in out), "on_done still called"
print(len(out), [r.error for r in out])
"""


@pytest.mark.parametrize("tty", [True, False])
def test_use_tqdm_draws_a_bar_on_stderr_only(tiny_llama_dir: Path, tty: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    if tty:
        env["FORCE_COLOR"] = "1"  # rich draws as on a terminal
    proc = subprocess.run([sys.executable, "-c", PROGRESS, str(tiny_llama_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "3 [None, None, None]\n"
    assert ("generating" in proc.stderr and "100%" in proc.stderr) == tty


def test_dict_prompts_are_the_text_or_ids_they_hold(llm: LLM) -> None:
    ids = llm.tokenizer("c d e").input_ids
    plain = llm.generate(["a b", ids], greedy())
    wrapped = llm.generate([{"prompt": "a b"}, {"prompt_token_ids": ids}], greedy())
    (alone,) = llm.generate({"prompt": "a b"}, greedy())
    assert [r.outputs[0].token_ids for r in wrapped] == [r.outputs[0].token_ids for r in plain]
    assert alone.outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.mark.parametrize(("prompt", "match"), [
    ({"prompt": "a", "multi_modal_data": {}}, r"^prompts\[0\]: 'multi_modal_data' is not supp"),
    ({}, r"^prompts\[0\]: give one of 'prompt' and 'prompt_token_ids'$"),
    ({"prompt": "a", "prompt_token_ids": [5]}, r"^prompts\[0\]: give one of"),
    ({"prompt": 5}, r"^prompts\[0\]: 'prompt' must be text$"),
    ({"prompt_token_ids": []},
     r"^prompts\[0\]\.prompt_token_ids: a list of token ids must not be empty$"),
    ({"prompt_token_ids": "abc"},
     r"^prompts\[0\]\.prompt_token_ids: a prompt is text, .* not str$"),
    ({"prompt_token_ids": [5, 6.0]}, r"^prompts\[0\]\.prompt_token_ids\[1\]: .* not float$"),
    ([5, 1.5], r"^prompts\[0\]\[1\]: a token id is an int, not float$"),  # (never rounded)
    ([True], r"^prompts\[0\]\[0\]: a token id is an int, not bool$"),
    (["a"], r"^prompts\[0\]\[0\]: a token id is an int, not str$"),
    ([], r"^prompts\[0\]: a list of token ids must not be empty$"),
    (b"ab", r"^prompts\[0\]: a prompt is text, a list of token ids, a dict or messages, not b"),
    (None, r"^prompts\[0\]: .* not NoneType$"),
])
def test_a_bad_prompt_is_refused_by_name(llm: LLM, prompt: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], greedy())
    assert llm.generate([[5, 6]], greedy())[0].error is None  # (and the engine serves on)


@pytest.mark.parametrize("topology", ["single", "engine"])
def test_results_carry_the_prompt_ids_the_engine_ran(tiny_llama_dir: Path,
                                                     topology: str) -> None:
    """vLLM's ``RequestOutput.prompt_token_ids`` and ``request_id``: the ids the
    Tokenizer made (text, chat template) or was given, on every result, in both
    topologies (in ``engine`` they cross the codec); () where none were made."""
    with LLM(model=str(tiny_llama_dir), num_kv_blocks=64, topology=topology) as llm:
        text, ids = "a b c", [7, 8, 9, 10]
        plain = SamplingParams(temperature=0.0, max_tokens=2, n=2)
        lps = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
        a, b, c = llm.generate([text, ids, {"prompt": text}], [plain, plain, lps])
        (d,) = llm.chat(TALK, plain)
        (bad,) = llm.generate([[10**9]], plain)
    assert a.prompt_token_ids == c.prompt_token_ids == tuple(llm.get_tokenizer()(text).input_ids)
    assert b.prompt_token_ids == tuple(ids)
    assert d.prompt_token_ids == tuple(template_ids(llm, TALK))
    assert all(len(r.prompt_token_ids) == r.num_prompt_tokens for r in (a, b, c, d))
    assert a.request_id == a.rid and len({a.rid, b.rid, c.rid}) == 3
    assert bad.error is not None and bad.prompt_token_ids == ()
    assert a.finished and a.outputs[0].cumulative_logprob is None  # (no logprobs asked)


def test_truncate_prompt_tokens_runs_the_prompts_tail(llm: LLM, tiny_llama_dir: Path) -> None:
    """vLLM's ``truncate_prompt_tokens``: the last k ids run (text, ids and chat alike),
    greedy output is transformers' on those ids, and the counts are of them; -1 keeps
    what the context holds; 0, or more than the context, is refused by name."""
    ids = list(range(20, 45))
    text = "the river runs down to the sea and the sea runs on " * 2
    cut = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True,
                         truncate_prompt_tokens=9)
    a, b = llm.generate([ids, text], cut)
    (c,) = llm.chat(TALK, cut)
    text_ids = llm.get_tokenizer()(text).input_ids
    assert len(text_ids) > 9
    for res, whole in ((a, ids), (b, text_ids), (c, template_ids(llm, TALK))):
        assert res.error is None, res.error
        assert res.prompt_token_ids == tuple(whole[-9:]) and res.num_prompt_tokens == 9
        assert list(res.outputs[0].token_ids) == hf_greedy(tiny_llama_dir, whole[-9:], N)[0]
    (whole,) = llm.generate([ids], SamplingParams(max_tokens=N, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == tuple(ids)
    (zero,) = llm.generate([ids], SamplingParams(truncate_prompt_tokens=0))
    assert zero.error is not None and "truncate_prompt_tokens must be -1 or at least" in zero.error
    (over,) = llm.generate([ids], SamplingParams(truncate_prompt_tokens=10**6))
    assert over.error is not None and "truncate_prompt_tokens (1000000)" in over.error


def test_cumulative_logprob_is_the_sampled_tokens_logprobs_summed(llm: LLM) -> None:
    (res,) = llm.generate(["a b"], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    out = res.outputs[0]
    assert len(out.logprobs) == 4 and [lp.token_id for lp in out.logprobs] == list(
        out.token_ids)
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    assert out.cumulative_logprob < 0


WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_are_rendered_by_a_template_that_reads_them() -> None:
    # The embedded model's template lists the tools in a system block of its own.
    with LLM(num_kv_blocks=64) as llm:
        ask = [{"role": "user", "content": "Is it raining in Oslo?"}]
        (plain,) = llm.chat(ask, greedy())
        (tooled,) = llm.chat(ask, greedy(), tools=[WEATHER])
        ids = llm.tokenizer.apply_chat_template(ask, tools=[WEATHER], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
        assert tooled.num_prompt_tokens == len(ids) > plain.num_prompt_tokens
        with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.name: "):
            llm.chat(ask, greedy(), tools=[{"type": "function", "function": {"name": "a b"}}])
        with pytest.raises(ValueError, match=r"^tools: function names must be unique$"):
            llm.chat(ask, greedy(), tools=[WEATHER, WEATHER])


def test_tools_are_refused_where_the_template_does_not_read_them(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^tools: the chat template does not read tools$"):
        llm.chat(TALK, greedy(), tools=[WEATHER])
