"""Structured output: a grammar per sequence that masks the logits before each draw.

A request's :class:`~actorllm.messages.StructuredOutput` (a JSON schema, a regex, a list
of choices or a Lark/GBNF grammar) is compiled by a :class:`GrammarBackend` into a
template matcher, cached per distinct spec; each sequence gets its own copy
(:class:`Grammar`), which lives in the Worker's ``SamplingState``. Each step the Worker
fills the allowed-token bitmask of every constrained row and sets the others to
``-inf`` (:func:`apply_grammar_masks`); ``SamplingState.append`` advances the matcher
with the sampled token. A grammar that is complete and admits nothing more allows only
the EOS tokens, so the sequence ends with ``stop`` through the ordinary EOS path.

The backend is llguidance: a self-contained Rust wheel (no torch, triton or compiler
at run time), with a fast mask on the CPU and lazy compilation, so a schema costs
about a millisecond to compile. xgrammar, vLLM's other engine, pulls torch's triton on
Linux x86-64 and would plug in as another :class:`GrammarBackend`.

JSON is compiled without free whitespace, with ``", "`` and ``": "`` as separators: a
small model allowed arbitrary whitespace inside an object can spend its whole budget on
newlines, and the output stays valid JSON for any parser.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from actorllm.messages import InvalidRequest, StructuredOutput

if TYPE_CHECKING:  # torch is imported where masks are applied: the Tokenizer needs none
    from torch import Tensor

log = logging.getLogger(__name__)

_CACHE_SIZE = 256  # distinct grammars kept compiled per backend
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar(Protocol):
    """One sequence's matcher: the tokens it allows next, and what it was given so far."""

    def fill_bitmask(self, row: Tensor) -> None:
        """Write the allowed next tokens into ``row``, an ``int32[words]`` bitmask on the CPU."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (a token the mask did not allow puts it in error)."""

    @property
    def words(self) -> int:
        """Width of the bitmask in 32-bit words."""


class GrammarBackend(Protocol):
    """Compiles specs (cached) and makes per-sequence matchers; thread-safe."""

    def check(self, spec: StructuredOutput) -> None:
        """Raise :class:`InvalidRequest` naming ``spec.param`` if the spec does not compile."""

    def grammar(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for one sequence, advanced past ``replay`` (after preemption)."""


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar text for a spec; InvalidRequest for one that is not well formed."""
    from llguidance import LLMatcher, grammar_from

    bad = InvalidRequest  # short alias for the raises below
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except ValueError as exc:
            raise bad(f"{spec.param}: the schema is not JSON: {exc}", spec.param) from None
        if not isinstance(schema, dict | bool):
            raise bad(f"{spec.param}: a JSON schema must be an object", spec.param)
        return LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {},
                                                  defaults=_JSON_OPTIONS)  # type: ignore
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.spec)
        except ValueError:
            choices = None
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise bad(f"{spec.param}: choices must be a non-empty list of non-empty strings",
                      spec.param)
        # A regex alternation of the escaped choices (Lark string escapes differ from JSON's).
        import re

        return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in choices))
    if spec.kind == "grammar":
        try:
            return grammar_from("grammar", spec.spec)
        except ValueError as exc:
            raise bad(f"{spec.param}: {exc}", spec.param) from None
    raise bad(f"{spec.param}: unknown kind {spec.kind!r}", spec.param)


class _LLGuidanceGrammar:
    """A :class:`Grammar` over one ``llguidance.LLMatcher``."""

    __slots__ = ("_m", "words")

    def __init__(self, matcher: Any, words: int) -> None:
        self._m, self.words = matcher, words

    def fill_bitmask(self, row: Tensor) -> None:
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> None:
        if not self._m.consume_token(token_id):
            log.warning("grammar refused token %d: %s", token_id, self._m.get_error())

    @property
    def matcher(self) -> Any:
        return self._m


class LLGuidanceBackend:
    """:class:`GrammarBackend` on llguidance, for one HF fast tokenizer and vocabulary.

    ``eos_token_ids`` are what a finished grammar allows. The llguidance tokenizer is
    built on first use (tens of milliseconds), so an engine that never sees a grammar
    never pays for it. Compiled templates are cached per spec (LRU of 256); each
    sequence gets a ``deep_copy``.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, list(eos_token_ids)
        self._tok: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()

    def _tokenizer(self) -> Any:
        if self._tok is None:
            import llguidance.hf

            self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                     eos_token=self._eos)
        return self._tok

    def _template(self, spec: StructuredOutput) -> Any:
        key = StructuredOutput(spec.kind, spec.spec)  # the param does not change the grammar
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tok = self._tokenizer()
        from llguidance import LLMatcher

        text = _grammar_text(spec)
        matcher = LLMatcher(tok, text, log_level=0)  # drops the GIL while it compiles
        if matcher.is_error():
            error = matcher.get_error().strip().splitlines()
            raise InvalidRequest(f"{spec.param}: {' '.join(e.strip() for e in error[:3])}",
                                 spec.param)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        self._template(spec)

    def grammar(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> Grammar:
        matcher = self._template(spec).deep_copy()
        if replay and not matcher.consume_tokens(list(replay)):
            raise ValueError(f"replaying {len(replay)} tokens into the grammar failed: "
                             f"{matcher.get_error()}")
        return _LLGuidanceGrammar(matcher, (self._tokenizer().vocab_size + 31) // 32)


_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor()
    return _EXECUTOR


def apply_grammar_masks(logits: Tensor, grammars: Sequence[Grammar | None]) -> None:
    """Set ``logits[i, t] = -inf`` for every token ``t`` row ``i``'s grammar does not allow.

    Rows whose grammar is None are left alone and cost nothing but their list entry.
    The bitmasks are filled on the CPU and unpacked to booleans in one tensor operation.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import torch

    vocab = logits.shape[1]
    words = max(grammars[i].words for i in rows)  # type: ignore[union-attr]
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    batched = [(g.matcher, j) for j, i in enumerate(rows)
               if isinstance(g := grammars[i], _LLGuidanceGrammar) and g.words == words]
    if len(batched) > 1:  # llguidance fills many rows on its own threads, without the GIL
        _executor().unsafe_compute_mask_ptr(batched, bitmask.data_ptr(), words * 4, len(rows))
    done = {j for _, j in batched} if len(batched) > 1 else set()
    for j, i in enumerate(rows):
        if j not in done:
            grammars[i].fill_bitmask(bitmask[j])  # type: ignore[union-attr]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(len(rows), words * 32)[:, :vocab]
    if allowed.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed.to(device=logits.device, dtype=torch.bool, non_blocking=True)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
