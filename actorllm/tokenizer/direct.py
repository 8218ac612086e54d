"""Short inputs encoded without handing the GIL away (:class:`DirectEncoder`).

transformers encodes through ``tokenizers.Tokenizer.encode_batch`` (``tokenizer(text)``,
and ``apply_chat_template(tokenize=True)``, which renders and then calls it), and
``encode_batch`` releases the GIL. On the loop of ``single`` the Worker's step thread
then takes the GIL, and the loop waits to get it back, up to the interpreter's switch
interval (5 ms), once per request. Beside a busy Python thread that measured 1-2 ms of
wall time for a 600-character prompt against ~0.3 ms for ``Tokenizer.encode``, which
keeps the GIL; the Rust work is ~0.15 ms either way. A burst of 64 chat requests paid it
64 times on the loop before the Scheduler saw them, and a py-spy profile of a chat burst
put most of the Tokenizer's samples there.

``encode`` is used only where it is checked to give transformers' ids (a few probe
texts, with and without special tokens, and a probe conversation through the chat
template), and only for inputs up to ``max_chars``: a long input goes through
transformers in a thread, where releasing the GIL is the point.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# Texts that exercise what could make the two paths differ: leading and repeated spaces,
# newlines, non-ASCII, byte fallback, digits, and (added per tokenizer) special tokens.
PROBES = ("Hello, world!", "  two  spaces\nand\ta tab ", "ünïcödé, 東京, 🙂 and a\u200bzero-width",
          "x = 12345.678; y = f(x)  # code", " leading space")
PROBE_CHAT = ({"role": "user", "content": "Hello there! ünïcödé 🙂  twice  spaced"},)


def _ids(out: Any) -> list[int]:
    """transformers' ids: a BatchEncoding (transformers 5) or a plain list."""
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


class DirectEncoder:
    """``tokenizers.Tokenizer.encode`` where it agrees with transformers; None otherwise."""

    def __init__(self, tok: Any, max_chars: int) -> None:
        self.tok, self.max_chars = tok, max_chars
        self.backend = self._verified_backend(tok)
        self.chat_ok = self.backend is not None and self._chat_agrees()

    @staticmethod
    def _verified_backend(tok: Any) -> Any:
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode"):
            return None  # a slow (Python) tokenizer: nothing to bypass
        specials = [s for s in getattr(tok, "all_special_tokens", ()) if isinstance(s, str)]
        texts = [*PROBES, "".join(f"{s} text {s}" for s in specials[:4])]
        try:
            for text in texts:
                for special in (True, False):
                    want = _ids(tok(text, add_special_tokens=special).input_ids)
                    if backend.encode(text, add_special_tokens=special).ids != want:
                        log.info("tokenizer: direct encoding differs from transformers' "
                                 "on %r; transformers' path kept", text)
                        return None
        except Exception:  # any oddity in a custom tokenizer: keep transformers' path
            log.info("tokenizer: direct encoding not checked; transformers' path kept",
                     exc_info=True)
            return None
        if getattr(backend, "truncation", None) or getattr(backend, "padding", None):
            return None  # transformers sets these per call; encode would apply them as set
        return backend

    def _chat_agrees(self) -> bool:
        if getattr(self.tok, "chat_template", None) is None:
            return False
        try:
            want = _ids(self.tok.apply_chat_template(list(PROBE_CHAT),
                                                     add_generation_prompt=True, tokenize=True))
            text = self.tok.apply_chat_template(list(PROBE_CHAT), add_generation_prompt=True,
                                                tokenize=False)
        except Exception:  # a template that refuses the probe: keep transformers' path
            return False
        return isinstance(text, str) and self._encode(text, False) == want

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def text(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids of ``text``, or None where transformers' path must encode it."""
        if self.backend is None or len(text) > self.max_chars:
            return None
        return self._encode(text, add_special_tokens)

    def chat(self, convo: list[dict[str, Any]], add_generation_prompt: bool,
             **kwargs: Any) -> list[int] | None:
        """The ids of a conversation through the chat template (rendered by transformers,
        encoded here), or None where transformers' path must do both."""
        if not self.chat_ok:
            return None
        text = self.tok.apply_chat_template(convo, add_generation_prompt=add_generation_prompt,
                                            tokenize=False, **kwargs)
        if not isinstance(text, str) or len(text) > self.max_chars:
            return None
        # The template writes the special tokens itself (transformers adds none either).
        return self._encode(text, False)
