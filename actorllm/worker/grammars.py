"""The Worker's structured-output matchers: one per constrained rid, made from the
grammar backend (built on the first grammar: loading the tokenizer for llguidance is not
free) and kept in that rid's sampling state (worker/sampling_batch.py)."""

from __future__ import annotations

from collections.abc import Sequence

from actorllm.text.structured import Grammar, GrammarBackend, LLGuidanceBackend
from actorllm.wire.steps import NewSeqData


class Grammars:
    """The backend, once built, and the rids whose sampling state holds a matcher."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model_dir, self._vocab_size = model_dir, vocab_size
        self._eos = tuple(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self.constrained: set[str] = set()

    def __bool__(self) -> bool:
        """Whether some held rid is constrained (a free batch skips the masks)."""
        return bool(self.constrained)

    def fresh(self, rid: str, new: NewSeqData) -> Grammar | None:
        """A fresh matcher for a structured-output sequence, advanced past what it has made
        (a preempted sequence comes back with its output tokens). The Tokenizer checked the
        spec, so a failure here is a bug and fails the step."""
        self.constrained.discard(rid)
        spec = new.params.structured
        if spec is None:
            return None
        if self._backend is None:
            from actorllm.text.hf import load_hf_tokenizer

            self._backend = LLGuidanceBackend(load_hf_tokenizer(self._model_dir),
                                              self._vocab_size, self._eos)
        grammar = self._backend.grammar(spec, new.output_token_ids)
        self.constrained.add(rid)
        return grammar

    def discard(self, rid: str) -> None:
        self.constrained.discard(rid)

    def clear(self) -> None:
        self.constrained.clear()
