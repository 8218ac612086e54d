"""Structured output: a grammar per sequence that masks the logits before each draw.

A request's :class:`~actorllm.wire.messages.StructuredOutput` (a JSON schema, a regex, a list
of choices or a Lark/GBNF grammar) is compiled by a :class:`GrammarBackend` into a
template matcher, cached per distinct spec; each sequence gets its own copy
(:class:`Grammar`), which lives in the Worker's ``SamplingState``. Each step the Worker
has the allowed-token bitmasks of the constrained rows filled in a thread while the
forward pass runs (:class:`MaskFiller`), then sets those rows' disallowed logits to
``-inf``; ``SamplingState.append`` advances the matcher with the sampled token. A
grammar that is complete and admits nothing more allows only the EOS tokens, so the
sequence ends with ``stop`` through the ordinary EOS path. A sampled token the grammar
refuses (the mask and the draw disagreed) raises :class:`GrammarRefused`: the step fails
with that error rather than the sequence going on unconstrained.

A JSON schema's numbers must be ones the grammar compiler holds exactly: integers within
+-(2**53 - 1), finite floats (:func:`check_schema_numbers`); others are a 400 naming the
field.

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
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from actorllm.wire.messages import InvalidRequest, StructuredOutput

if TYPE_CHECKING:  # torch is imported where masks are applied: the Tokenizer needs none
    import torch
    from torch import Tensor

log = logging.getLogger(__name__)

_CACHE_SIZE = 256  # distinct grammars kept compiled per backend
# llguidance reads a schema's numbers as serde_json values and writes some through an f64:
# an integer beyond 2**53 would be generated as another number, so only the integers an
# f64 holds exactly (I-JSON's interoperable range, RFC 7493) are taken.
_INT_MAX = 2**53 - 1
_INT_MIN = -_INT_MAX


class GrammarRefused(ValueError):
    """A sampled token that the sequence's grammar does not allow."""


def check_schema_numbers(schema: Any, param: str, path: str = "$") -> None:
    """Raise InvalidRequest naming ``param`` (and where in the schema) for a number the
    grammar compiler cannot hold exactly: an integer beyond +-(2**53 - 1) (past 2**64
    llguidance refuses it; past 2**53 it generates a neighbour) or a non-finite float
    (JSON text such as ``1e999`` parses as infinity, and would become ``null``)."""
    # An explicit stack, not recursion: a schema nested thousands deep must not overflow.
    stack: list[tuple[Any, str]] = [(schema, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                raise InvalidRequest(f"{param}: the integer at {where} is beyond "
                                     f"+-(2**53 - 1), the integers JSON numbers hold exactly",
                                     param)
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise InvalidRequest(f"{param}: the number at {where} is not finite "
                                     f"(JSON numbers such as 1e999 overflow)", param)
        elif isinstance(value, dict):
            stack.extend((v, f"{where}.{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar(Protocol):
    """One sequence's matcher: the tokens it allows next, and what it was given so far."""

    def fill_bitmask(self, row: Tensor) -> None:
        """Write the allowed next tokens into ``row``, an ``int32[words]`` bitmask on the CPU."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; raises :class:`GrammarRefused` for one it does not allow."""

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
    body = _body_text(spec)
    if spec.frame is None:
        return body
    # The frame and the constraint as separate grammars of one top-level grammar: the
    # frame refers to the constraint as @body, and their rule names cannot clash.
    if body.lstrip().startswith("{"):  # already a top-level grammar (JSON, regex)
        inner = json.loads(body)["grammars"]
        inner[0] = {**inner[0], "name": "body"}
    else:  # Lark text
        inner = [{"name": "body", "lark_grammar": body}]
    return json.dumps({"grammars": [{"lark_grammar": spec.frame}, *inner]})


def _body_text(spec: StructuredOutput) -> str:
    """The grammar text of the constraint itself (without its frame)."""
    from llguidance import LLMatcher, grammar_from

    bad = InvalidRequest  # short alias for the raises below
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except ValueError as exc:
            raise bad(f"{spec.param}: the schema is not JSON: {exc}", spec.param) from None
        if not isinstance(schema, dict | bool):
            raise bad(f"{spec.param}: a JSON schema must be an object", spec.param)
        check_schema_numbers(schema, spec.param)
        try:
            return LLMatcher.grammar_from_json_schema(  # type: ignore[no-any-return]
                schema if isinstance(schema, dict) else {}, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:  # whatever else serde refuses: the client's
            raise bad(f"{spec.param}: {exc}", spec.param) from None
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
            # Going on would generate unconstrained output and call it constrained.
            raise GrammarRefused(f"the output constraint refused sampled token {token_id} "
                                 f"({self._m.get_error().strip()})")

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
        key = StructuredOutput(spec.kind, spec.spec, frame=spec.frame)  # (not the param)
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


def _fill(grammars: Sequence[Grammar]) -> Tensor:
    """The rows' allowed-token bitmasks, ``int32[len(grammars), words]`` on the CPU.

    llguidance's executor fills its matchers on its own threads with the GIL released;
    any other :class:`Grammar` fills its row itself.
    """
    import torch

    words = max(g.words for g in grammars)
    bitmask = torch.zeros((len(grammars), words), dtype=torch.int32)
    batched = [(g.matcher, j) for j, g in enumerate(grammars)
               if isinstance(g, _LLGuidanceGrammar) and g.words == words]
    if batched:
        _executor().unsafe_compute_mask_ptr(batched, bitmask.data_ptr(), words * 4,
                                            len(grammars))
    done = {j for _, j in batched}
    for j, g in enumerate(grammars):
        if j not in done:
            g.fill_bitmask(bitmask[j])
    return bitmask


def _bias(bitmask: Tensor, vocab: int, in_numpy: bool | None = None) -> Tensor:
    """``float32[rows, vocab]``: 0 where the bitmask allows the token, ``-inf`` elsewhere
    (ids past the bitmask's width are never allowed). ``in_numpy``: unpack with numpy
    (the default for a CPU tensor) or with torch shifts (on the bitmask's device).

    An additive bias rather than a boolean mask: on the CPU ``logits += bias`` costs
    microseconds where ``masked_fill`` with a boolean mask costs a millisecond.
    """
    import torch

    rows, words = bitmask.shape
    if in_numpy is None:
        in_numpy = bitmask.device.type == "cpu" and sys.byteorder == "little"
    if in_numpy:
        import numpy as np

        # Bit j of word w is token 32 * w + j (little-endian words).
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        of_bit = np.array([-np.inf, 0.0], dtype=np.float32)  # a 0 bit is a banned token
        bias = torch.from_numpy(np.take(of_bit, bits[:, :vocab]))
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = ((bitmask[:, :, None] >> shifts) & 1).view(rows, words * 32)[:, :vocab]
        bias = torch.zeros(bits.shape, device=bitmask.device).masked_fill_(bits == 0,
                                                                           float("-inf"))
    if bias.shape[1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    return bias


class PendingMasks:
    """One step's grammar masks, being computed while the forward pass runs.

    ``apply`` waits for them and bans the disallowed tokens of the constrained rows;
    ``wait`` only waits (a step that failed must not leave a thread touching matchers).
    """

    def __init__(self, rows: list[int], future: Future[Tensor], vocab: int) -> None:
        self.rows, self._future, self._vocab = rows, future, vocab

    def wait(self) -> None:
        """Block until the thread is done with the matchers; errors are the step's to report."""
        futures.wait([self._future])

    def apply(self, logits: Tensor) -> None:
        """Set ``logits[row, t] = -inf`` for every token ``t`` a constrained row may not take."""
        import torch

        out = self._future.result()
        if out.dtype == torch.int32:  # packed bits: unpacked where the logits are
            out = _bias(out.to(logits.device, non_blocking=True), self._vocab)
        bias = out.to(device=logits.device, dtype=logits.dtype, non_blocking=True)
        if bias.shape[1] != logits.shape[1]:
            raise ValueError(f"grammar masks of width {bias.shape[1]} for logits of "
                             f"{logits.shape[1]}")
        if len(self.rows) == logits.shape[0]:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(self.rows, device=logits.device), bias)


class MaskFiller:
    """Computes a step's grammar masks in a thread of its own, beside the forward pass.

    ``start`` is called before the forward with the grammars of the rows the step will
    sample (None for a free row), after the previous step's tokens were accepted; the
    Worker touches no matcher until it has called ``apply`` or ``wait``. On the CPU the
    thread also unpacks the bits into the additive bias; on an accelerator the packed
    bitmask crosses (a 32nd of the bytes) and is unpacked there. A step with no
    constrained row costs one scan of the list and starts nothing. ``overlap = False``
    computes them in ``start`` itself (the serial baseline, for benchmarks/structured.py).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self._vocab, self._device = vocab_size, device
        self._pool: ThreadPoolExecutor | None = None
        self.overlap = True

    def start(self, grammars: Sequence[Grammar | None]) -> PendingMasks | None:
        """Begin the masks of the constrained rows, or None when there are none."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        chosen = [grammars[i] for i in rows]
        if not self.overlap:
            done: Future[Tensor] = Future()
            done.set_result(self._work(chosen))
            return PendingMasks(rows, done, self._vocab)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return PendingMasks(rows, self._pool.submit(self._work, chosen), self._vocab)

    def _work(self, grammars: list[Grammar]) -> Tensor:
        bitmask = _fill(grammars)
        if self._device.type == "cpu":
            return _bias(bitmask, self._vocab)
        # Pinned, so that the copy to the device does not block the step.
        return bitmask.pin_memory() if self._device.type == "cuda" else bitmask


def apply_grammar_masks(logits: Tensor, grammars: Sequence[Grammar | None]) -> None:
    """Set ``logits[i, t] = -inf`` for every token ``t`` row ``i``'s grammar does not allow.

    The synchronous form of :class:`MaskFiller` (same masks, no thread). Rows whose
    grammar is None are left alone and cost nothing but their list entry.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    future: Future[Tensor] = Future()
    future.set_result(_fill([g for g in grammars if g is not None]))
    PendingMasks(rows, future, logits.shape[1]).apply(logits)
