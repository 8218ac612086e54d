"""Fuzz the Detokenizer: arbitrary token ids (and stop strings) through its decode path.

Contract (actorllm/detokenizer/actor.py, invariant 7): it never raises; every delta is valid
UTF-8; one ``RequestFinished`` ends the request and nothing follows it; the deltas
concatenate to ``decode(ids)``, cut at the first stop string (after it, with
``include_stop_str_in_output``) when one matches.

It runs the default model's real byte-level BPE tokenizer (4096 ids). Token ids cover
the vocabulary, ids just past it (a model's vocabulary is often padded beyond its
tokenizer's), and any id a sampler can return (below 2**31).

Input: byte 0: flags (skip special tokens, include the stop string, 0-3 stop strings),
byte 1: tokens per TokenOut (1-8); then each stop string as a length byte (0-3) and that
many token ids; then the token ids: 2 bytes each, or 5 (a 0xFF marker, then 4 bytes)
for a large one.

    python fuzz/fuzz_detokenizer.py -atheris_runs=20000 fuzz/corpus/detokenizer
"""

from __future__ import annotations

import types

import tokenizers
from _harness import main

from actorllm.config import default_model_dir
from actorllm.detokenizer.actor import Detokenizer
from actorllm.detokenizer.decoding import hf_decode_fn
from actorllm.wire.messages import DetokSetup, RequestFinished, StopMatched, TextDelta, TokenOut

NAME = "detokenizer"
_TOKENIZER = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
DECODE = hf_decode_fn(types.SimpleNamespace(backend_tokenizer=_TOKENIZER))
VOCAB = _TOKENIZER.get_vocab_size()


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.i = data, 0

    def byte(self) -> int:
        b = self.data[self.i] if self.i < len(self.data) else 0
        self.i += 1
        return b

    def token(self) -> int:
        if self.byte() == 0xFF:
            return int.from_bytes(bytes(self.byte() for _ in range(4)), "big") % 2**31
        self.i -= 1
        return int.from_bytes(bytes((self.byte(), self.byte())), "big") % (VOCAB + 64)

    def more(self) -> bool:
        return self.i < len(self.data)


def reference(text: str, stops: tuple[str, ...], include: bool) -> str:
    """What the client must read: ``text`` cut at the stop string complete first."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text
    # The first to be complete, then the first to begin: how the text reads as it streams.
    i, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
    return text[: i + len(stop)] if include else text[:i]


def TestOneInput(data: bytes) -> None:
    r = _Reader(data)
    flags, chunk = r.byte(), r.byte() % 8 + 1
    skip, include = bool(flags & 1), bool(flags & 2)
    stops = tuple(s for s in (DECODE([r.token() for _ in range(r.byte() % 4)], skip)
                              for _ in range(flags >> 2 & 3)) if s)
    ids = []
    while r.more():
        ids.append(r.token())
    detok = Detokenizer(DECODE, None, None, None)  # type: ignore[arg-type]  # no mailboxes
    spec = DetokSetup(stops, include, skip, 0)
    deltas: list[TextDelta] = []
    finished: list[RequestFinished] = []
    matched: list[StopMatched] = []
    pieces = [ids[i : i + chunk] for i in range(0, len(ids), chunk)] or [[]]
    for n, piece in enumerate(pieces):
        final = n == len(pieces) - 1
        assert not finished, "output after the final one"
        detok._process(TokenOut("r", tuple(piece), finish_reason="length" if final else None,
                                spec=spec if n == 0 else None), deltas, finished, matched)
    assert len(finished) == 1 and not detok.states and len(matched) <= 1
    for d in deltas:
        d.text.encode("utf-8")  # strict: a lone surrogate would raise
    text = "".join(d.text for d in deltas)
    expected = reference(DECODE(ids, skip), stops, include)
    assert text == expected, (ids, stops, include, text, expected)
    if matched:
        assert finished[0].finish_reason == "stop" and finished[0].stop_reason in stops


if __name__ == "__main__":
    main(TestOneInput)
