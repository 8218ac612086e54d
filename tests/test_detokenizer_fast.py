"""The Detokenizer's fast path (piece table, batched windowed decodes) against plain decode.

Invariant 7 whatever path a token takes: the deltas of a rid concatenate to
``decode(all its ids)`` (cut at the first stop string), never split a UTF-8 character,
and deliver the ids up to the one that completed a stop string. Three tokenizers: the
embedded model's byte-level BPE (4096 ids), the tiny byte-level BPE trained for the
suite, and a SentencePiece-style one (Metaspace: the first token loses its leading
space, so a request's first token must not take the table).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import attrs
import tokenizers
import trio
from helpers import CORPUS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.config import default_model_dir
from actorllm.detokenizer.actor import Detokenizer
from actorllm.detokenizer.decoding import (
    IncrementalDecoder,
    StopMatcher,
    TokenizerDecode,
    build_piece_table,
    hf_decode_fn,
)
from actorllm.wire.mailbox import MailboxClosed
from actorllm.wire.messages import DetokSetup, OutputBatch, StopMatched, TokenBatch, TokenOut

SAMPLES = (
    "The river runs past the old mill and under the stone bridge.",
    "héllo → 世界 🙂 naïve café, emoji 🙂🙃 and CJK 漢字 mixed with ASCII",
    "  leading spaces and\nnew lines\n\n  def f(x):\n    return x + 1\n",
)


@functools.cache
def embedded() -> TokenizerDecode:
    return TokenizerDecode(
        tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")))


@functools.cache
def metaspace() -> TokenizerDecode:
    """A BPE with SentencePiece's space handling, trained here on the suite's corpus."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = tokenizers.decoders.Metaspace(prepend_scheme="first")
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return TokenizerDecode(tok)


def decoders(tiny_tokenizer: Any) -> dict[str, TokenizerDecode]:
    return {"embedded": embedded(), "tiny": hf_decode_fn(tiny_tokenizer),
            "metaspace": metaspace()}


def reference(text: str, stops: tuple[str, ...], include: bool) -> str:
    """What the client must read: ``text`` cut at the stop string complete first."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text
    i, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
    return text[: i + len(stop)] if include else text[:i]


def ids_strategy(dec: TokenizerDecode) -> st.SearchStrategy[list[int]]:
    """Ids mostly from real text (the table's case), some anywhere in the vocabulary
    (partial characters, unknown pieces), some special, some past the vocabulary."""
    backend = dec.backend
    size = backend.get_vocab_size(with_added_tokens=True)
    text_ids = sorted({t for s in SAMPLES for t in backend.encode(s, add_special_tokens=False).ids})
    special = sorted(backend.get_added_tokens_decoder())
    one = st.one_of(st.sampled_from(text_ids), st.sampled_from(text_ids),
                    st.sampled_from(text_ids), st.integers(0, size - 1),
                    st.sampled_from(special), st.integers(size, size + 8))
    return st.one_of(
        st.lists(one, max_size=40),
        # a run of real text, then anything
        st.builds(lambda s, k, tail: backend.encode(SAMPLES[s], add_special_tokens=False).ids[k:]
                  + tail, st.integers(0, len(SAMPLES) - 1), st.integers(0, 5),
                  st.lists(one, max_size=8)),
    )


@attrs.define
class Stream:
    rid: str
    ids: list[int]
    chunks: list[int]  # tokens per row, summing to len(ids)
    setup: DetokSetup
    split: set[int]  # steps where the row comes as two rows of the same rid in one batch


@st.composite
def streams(draw: st.DrawFn, dec: TokenizerDecode) -> list[Stream]:
    out = []
    for n in range(draw(st.integers(1, 4))):
        ids = draw(ids_strategy(dec))
        chunks: list[int] = []
        while sum(chunks) < len(ids):
            chunks.append(min(draw(st.sampled_from([1, 1, 1, 2, 3, 5])), len(ids) - sum(chunks)))
        skip = draw(st.booleans())
        stops: tuple[str, ...] = ()
        if draw(st.booleans()) and ids:
            # stop strings taken from the text itself, so that they match often
            full = dec(ids, skip)
            for _ in range(draw(st.integers(1, 3))):
                i = draw(st.integers(0, max(len(full) - 1, 0)))
                stop = full[i : i + draw(st.integers(1, 4))]
                if stop and "\ufffd" not in stop:
                    stops += (stop,)
        setup = DetokSetup(stops, draw(st.booleans()), skip, num_prompt_tokens=n)
        split = set(draw(st.lists(st.integers(0, len(chunks)), max_size=3)))
        out.append(Stream(f"r{n}", ids, chunks, setup, split))
    return out


class Box:
    """A peer's mailbox: an inbox of prepared batches (closed once they are taken), or an
    outbox that keeps."""

    def __init__(self, items: list[Any] | None = None) -> None:
        self.items = items or []
        self.taken = 0

    async def send(self, msg: Any) -> None:
        self.items.append(msg)

    def send_nowait(self, msg: Any) -> None:
        self.items.append(msg)

    async def receive(self) -> Any:
        await trio.lowlevel.checkpoint()
        return self.receive_nowait()

    def receive_nowait(self) -> Any:
        if self.taken == len(self.items):
            raise MailboxClosed("box")
        self.taken += 1
        return self.items[self.taken - 1]

    async def __aiter__(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item


def batches(streams: list[Stream]) -> list[TokenBatch]:
    """Step by step, every live rid's next chunk in one batch; the last step finishes it."""
    out = []
    pos = {s.rid: 0 for s in streams}
    for step in range(max(len(s.chunks) for s in streams) + 1):
        rows: list[TokenOut] = []
        for s in streams:
            if step > len(s.chunks):
                continue
            final = "length" if step == len(s.chunks) else None
            chunk = s.ids[pos[s.rid] : pos[s.rid] + s.chunks[step]] if not final else []
            pos[s.rid] += len(chunk)
            spec = s.setup if step == 0 else None
            if step in s.split and len(chunk) > 1:
                rows.append(TokenOut(s.rid, tuple(chunk[:1]), spec=spec))
                rows.append(TokenOut(s.rid, tuple(chunk[1:])))
            elif step in s.split and final:
                rows.append(TokenOut(s.rid, tuple(chunk), spec=spec))
                rows.append(TokenOut(s.rid, (), finish_reason=final))
            else:
                rows.append(TokenOut(s.rid, tuple(chunk), finish_reason=final, spec=spec))
        out.append(TokenBatch.of(tuple(rows)))
    return out


def run_actor(dec: Any, streams: list[Stream]) -> tuple[list[OutputBatch], list[StopMatched]]:
    front, sched = Box(), Box()
    detok = Detokenizer(dec, Box(list(batches(streams))), front, sched)
    trio.run(detok.run)
    assert not detok.drain_problems()
    return front.items, sched.items


def check(dec: TokenizerDecode, streams: list[Stream], got: list[OutputBatch],
          matched: list[StopMatched]) -> None:
    for s in streams:
        deltas = [d for b in got for d in b.deltas if d.rid == s.rid]
        fins = [f for b in got for f in b.finished if f.rid == s.rid]
        assert len(fins) == 1
        full = dec(s.ids, s.setup.skip_special_tokens)
        expected = reference(full, s.setup.stop, s.setup.include_stop_str_in_output)
        text = "".join(d.text for d in deltas)
        assert text == expected, (s, text, expected)
        for d in deltas:
            d.text.encode("utf-8")  # strict: a lone surrogate would raise
            if "\ufffd" not in full:
                assert "\ufffd" not in d.text  # no character split between deltas
        delivered = [t for d in deltas for t in d.token_ids]
        assert delivered == s.ids[: len(delivered)]
        hit = any(stop in full for stop in s.setup.stop)
        assert [m.rid for m in matched if m.rid == s.rid] == ([s.rid] if hit else [])
        if not hit:
            assert delivered == s.ids
        else:
            assert fins[0].finish_reason == "stop" and fins[0].stop_reason in s.setup.stop


def test_piece_tables_serve_most_tokens(tiny_tokenizer: Any) -> None:
    for name, dec in decoders(tiny_tokenizer).items():
        table = dec.pieces()
        assert len(table) == dec.backend.get_vocab_size(with_added_tokens=True), name
        served = sum(p is not None for p in table)
        assert served > len(table) // 2, (name, served)
        for t in dec.backend.get_added_tokens_decoder():
            assert table[t] is None, name  # added tokens always take the window
        assert dec.pieces() is table  # built once per tokenizer


def test_embedded_table_leaves_out_partial_characters() -> None:
    backend = embedded().backend
    table = embedded().pieces()
    for t in backend.encode("世界🙂漢字", add_special_tokens=False).ids:
        alone = backend.decode([t])
        assert (table[t] is None) == ("\ufffd" in alone)


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_table_pieces_append_to_plain_text(tiny_tokenizer: Any, data: st.DataObject) -> None:
    """decode(ctx + [t]) == decode(ctx) + piece[t] wherever the decoder would use it: the
    text so far is non-empty, ends in a whole character, and its last id has a piece."""
    for name, dec in decoders(tiny_tokenizer).items():
        table = dec.pieces()
        ctx = data.draw(ids_strategy(dec), label=name)
        t = data.draw(st.sampled_from([i for i, p in enumerate(table) if p is not None]))
        skip = data.draw(st.booleans())
        text = dec(ctx, skip)
        if not ctx or not text or text.endswith("\ufffd") or not 0 <= ctx[-1] < len(table):
            continue
        if table[ctx[-1]] is None:
            continue
        assert dec([*ctx, t], skip) == text + table[t], (name, ctx, t)


@settings(max_examples=examples(100), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decoder_with_table_equals_decode_in_any_chunking(
    tiny_tokenizer: Any, data: st.DataObject
) -> None:
    for name, dec in decoders(tiny_tokenizer).items():
        ids = data.draw(ids_strategy(dec), label=name)
        skip = data.draw(st.booleans())
        inc = IncrementalDecoder(dec, skip, pieces=dec.pieces())
        parts, i = [], 0
        while i < len(ids):
            k = data.draw(st.integers(1, 4))
            parts.append(inc.push(ids[i : i + k]))
            i += k
        parts.append(inc.flush())
        assert "".join(parts) == dec(ids, skip), (name, ids)


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_actor_equals_decode_for_interleaved_streams(
    tiny_tokenizer: Any, data: st.DataObject
) -> None:
    """Several rids per batch (so the windowed rows go through one decode_batch), random
    chunkings, a rid twice in one batch, with and without special tokens and stops."""
    for name, dec in decoders(tiny_tokenizer).items():
        ss = data.draw(streams(dec), label=name)
        got, matched = run_actor(dec, ss)
        check(dec, ss, got, matched)


def test_actor_with_a_plain_decode_function_agrees(tiny_tokenizer: Any) -> None:
    """Any DecodeFn still works (no table, no batch): the same text as the fast path."""
    dec = hf_decode_fn(tiny_tokenizer)

    def plain(ids: Any, skip: bool) -> str:
        return dec(ids, skip)

    ids = tiny_tokenizer(SAMPLES[0] + SAMPLES[1], add_special_tokens=False).input_ids
    ss = [Stream(f"r{i}", ids[i:], [1] * len(ids[i:]), DetokSetup(), set()) for i in range(3)]
    for fn in (dec, plain):
        got, matched = run_actor(fn, ss)
        check(dec, ss, got, matched)


def test_first_token_keeps_the_tokenizers_own_leading_space_rule() -> None:
    """A Metaspace tokenizer drops the first token's leading space; later ones keep it."""
    dec = metaspace()
    ids = dec.backend.encode("the river runs", add_special_tokens=False).ids
    ss = [Stream("r", ids, [1] * len(ids), DetokSetup(), set())]
    got, _ = run_actor(dec, ss)
    assert "".join(d.text for b in got for d in b.deltas) == dec(ids, True) == "the river runs"


def test_stop_matcher_without_stops_passes_text_through() -> None:
    m = StopMatcher(())
    assert m.feed("abc", final=False) == ("abc", None) and m.held == ""


def test_build_piece_table_without_anchors_is_empty() -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    assert build_piece_table(tok) == ()


def test_a_rid_twice_in_one_batch_sees_its_own_first_row() -> None:
    """Two rows of one rid in a batch, both needing the window (multibyte characters), for
    several rids at once: the second row must decode after the first, not beside it."""
    dec = embedded()
    texts = ("世界🙂漢字 and é→ü", "🙂🙃 naïve 漢字 café", "→→ 世界 world")
    ids = {f"r{i}": dec.backend.encode(t, add_special_tokens=False).ids
           for i, t in enumerate(texts)}
    rows_per_batch: list[list[TokenOut]] = []
    for step in range(0, max(map(len, ids.values())) + 2, 2):
        rows = []
        for rid, seq in ids.items():
            if step <= len(seq):
                for t in seq[step : step + 2]:
                    rows.append(TokenOut(rid, (t,), spec=DetokSetup() if step == 0 else None))
                if step + 2 > len(seq):
                    rows.append(TokenOut(rid, (), finish_reason="length"))
        rows_per_batch.append(rows)
    front = Box()
    detok = Detokenizer(dec, Box([TokenBatch.of(tuple(r)) for r in rows_per_batch]), front, Box())
    trio.run(detok.run)
    for rid, seq in ids.items():
        got = [d.text for b in front.items for d in b.deltas if d.rid == rid]
        assert "".join(got) == dec(seq, True)
        assert all("\ufffd" not in g for g in got)
