"""Incremental detokenization and stop strings (invariant 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.detokenizer.actor import Detokenizer
from actorllm.detokenizer.decoding import IncrementalDecoder, StopMatcher, hf_decode_fn
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    DetokSetup,
    FrontendInput,
    OutputBatch,
    SchedulerInput,
    StopMatched,
    TokenBatch,
    TokenLogprob,
    TokenOut,
)

TEXTS = [
    "Hello world, this is a test.",
    "héllo → 世界 🙂 naïve café",
    "emoji 🙂🙃 and CJK 漢字 mixed with ASCII",
    "  leading spaces and\nnew lines\n\n",
]


def deltas(decode: Any, ids: list[int], chunk: int = 1) -> list[str]:
    dec = IncrementalDecoder(decode)
    out = [dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    out.append(dec.flush())
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_decode_and_never_split_a_character(
    tiny_tokenizer: Any, text: str, chunk: int
) -> None:
    decode = hf_decode_fn(tiny_tokenizer)
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    parts = deltas(decode, ids, chunk)
    assert "".join(parts) == decode(ids, True) == text
    assert all("\ufffd" not in p for p in parts)


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_token_ids_concatenate_to_decode(tiny_tokenizer: Any, data: st.DataObject) -> None:
    decode = hf_decode_fn(tiny_tokenizer)
    ids = data.draw(st.lists(st.integers(0, len(tiny_tokenizer) - 1), max_size=30))
    assert "".join(deltas(decode, ids)) == decode(ids, True)


@pytest.mark.parametrize(
    ("text", "stops", "include", "expected"),
    [
        ("abc STOP def", ("STOP",), False, "abc "),
        ("abc STOP def", ("STOP",), True, "abc STOP"),
        ("one two three", ("wo t", "three"), False, "one t"),
        ("no match here", ("zzz",), False, "no match here"),
        ("café→end", ("→",), False, "café"),
        # the stop complete first wins, however the text is chunked (found by fuzzing)
        ("abcd", ("abcd", "bc"), False, "a"),
        ("stdout addresses addresses", ("stdout addresses addresses", " addresses"), True,
         "stdout addresses"),
        ("xab", ("b", "ab"), False, "x"),  # both complete at once: the one begun first
    ],
)
def test_stop_matcher_holds_back_and_cuts(text: str, stops: tuple[str, ...], include: bool,
                                          expected: str) -> None:
    for step in (1, 2, 5):
        m = StopMatcher(stops, include)
        out, hit = [], None
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            emit, hit = m.feed(piece, final=i == len(pieces) - 1)
            out.append(emit)
            if hit:
                break
        assert "".join(out) == expected


async def run_detok(tiny_tokenizer: Any, outs: list[TokenOut]) -> tuple[list[OutputBatch],
                                                                        list[StopMatched]]:
    inbox = Mailbox("d", TokenBatch, 64)
    front = Mailbox("f", FrontendInput, 64)
    sched = Mailbox("s", SchedulerInput, 64)
    detok = Detokenizer(hf_decode_fn(tiny_tokenizer), inbox, front, sched)
    for out in outs:
        await inbox.send(TokenBatch.of((out,)))
    inbox.close()
    await detok.run()
    batches, stops = [], []
    while front.depth:
        batches.append(front.receive_nowait())
    while sched.depth:
        stops.append(sched.receive_nowait())
    assert not detok.drain_problems()
    return batches, stops


async def test_actor_stops_across_token_boundaries_and_reports_to_scheduler(
    tiny_tokenizer: Any,
) -> None:
    text = "the cat sat on the mat and then"
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    spec = DetokSetup(stop=("on the",), num_prompt_tokens=3)
    outs = [TokenOut("r", (t,), spec=spec if i == 0 else None) for i, t in enumerate(ids)]
    outs.append(TokenOut("r", (), finish_reason="stop", stop_reason="on the"))
    batches, stops = await run_detok(tiny_tokenizer, outs)
    got = "".join(d.text for b in batches for d in b.deltas)
    assert got == "the cat sat "
    assert stops == [StopMatched("r", "on the")]
    fins = [f for b in batches for f in b.finished]
    assert [(f.finish_reason, f.stop_reason, f.num_prompt_tokens) for f in fins] == [
        ("stop", "on the", 3)]
    # No token after the one that completed the stop string reaches the client.
    delivered = [t for b in batches for d in b.deltas for t in d.token_ids]
    assert tiny_tokenizer.decode(delivered).startswith("the cat sat on the")
    assert len(delivered) < len(ids)


async def test_actor_multibyte_stream_flushes_at_finish(tiny_tokenizer: Any) -> None:
    text = "世界🙂"
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    outs = [TokenOut("r", (t,)) for t in ids[:-1]]
    outs.append(TokenOut("r", (ids[-1],), finish_reason="length"))
    batches, _ = await run_detok(tiny_tokenizer, outs)
    got = [d.text for b in batches for d in b.deltas]
    assert "".join(got) == text
    assert all("\ufffd" not in g for g in got)


async def test_unknown_rid_finish_without_tokens_is_fine(tiny_tokenizer: Any) -> None:
    batches, _ = await run_detok(tiny_tokenizer, [TokenOut("x", (), finish_reason="abort")])
    assert [(f.rid, f.finish_reason) for b in batches for f in b.finished] == [("x", "abort")]


async def test_a_plain_step_comes_out_as_columns_with_logprobs_kept_apart(
    tiny_tokenizer: Any,
) -> None:
    # Issue 28: text pieces are a column aligned with the rids; only a row with logprobs
    # gets an object, and its logprobs come back with its text and tokens.
    ids = tiny_tokenizer("the cat sat on", add_special_tokens=False).input_ids
    lp = TokenLogprob(ids[2], -0.5)
    outs = [TokenOut("r", (ids[0],), spec=DetokSetup()), TokenOut("r", (ids[1],)),
            TokenOut("r", (ids[2],), (lp,)), TokenOut("r", tuple(ids[3:]),
                                                      finish_reason="length")]
    batches, _ = await run_detok(tiny_tokenizer, outs)
    assert [b.rids for b in batches] == [("r",)] * 4
    assert [b.rare_rows for b in batches] == [(), (), (0,), ()]
    assert batches[2].deltas[0].logprobs == (lp,) and batches[2].rare[0].text == ""
    assert "".join(t for b in batches for t in b.texts) == "the cat sat on"
    assert [t for b in batches for t in b.token_ids] == ids


def test_the_engines_tokenizer_batches_run_on_one_thread_unless_the_user_says(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the model's tokenizer turns off the tokenizers library's thread per core
    for batch calls (the Detokenizer's batch decode ran on the cores the forward pass
    uses), by ``TOKENIZERS_PARALLELISM``; a value the user set stays."""
    import os

    from actorllm.text.hf import load_hf_tokenizer

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    load_hf_tokenizer(str(tiny_llama_dir))
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    load_hf_tokenizer(str(tiny_llama_dir))
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
