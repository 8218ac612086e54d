"""The Tokenizer actor: turns text or chat messages into validated token ids.

Owns nothing long-lived. Every ``TokenizeRequest`` leaves as exactly one
``SequenceRequest`` (to the Scheduler) or one ``RequestFailed`` (to the Frontend).
``AbortRequest`` is forwarded to the Scheduler on the same FIFO edge as the
requests, so it always arrives after the request it cancels.
"""

from __future__ import annotations

import logging
from typing import Any

from actorllm.config import ModelInfo
from actorllm.lifecycle import Ledger
from actorllm.mailbox import Inbox, Outbox
from actorllm.messages import (
    AbortRequest,
    FrontendInput,
    InvalidRequest,
    RequestFailed,
    SchedulerInput,
    SequenceRequest,
    TokenizeRequest,
    TokenizerInput,
)
from actorllm.trace import Tracer

log = logging.getLogger(__name__)


def load_hf_tokenizer(model_dir: str) -> Any:
    """The model's Hugging Face tokenizer, offline. ValueError with a one-line reason."""
    from transformers import AutoTokenizer  # slow import: only where needed

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad directory
        raise ValueError(f"cannot load a tokenizer from {model_dir}: {exc}") from None


class PromptEncoder:
    """Pure tokenization and validation; the actor below only moves messages."""

    def __init__(self, hf_tokenizer: Any, info: ModelInfo) -> None:
        self.tok = hf_tokenizer
        self.info = info

    def encode(self, req: TokenizeRequest) -> SequenceRequest:
        """Validate and tokenize; raises InvalidRequest with a clear message."""
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompt token ids or messages",
                                 "prompt")
        req.params.validate(self.info.vocab_size)
        if req.messages is not None:
            ids = self._chat(req)
        elif req.prompt is not None:
            if not req.prompt:
                raise InvalidRequest("prompt must not be empty", "prompt")
            ids = list(self.tok(req.prompt).input_ids)
        else:
            ids = list(req.prompt_token_ids or ())
            bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is not in the vocabulary "
                                     f"(size {self.info.vocab_size})", "prompt")
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        limit = self.info.max_model_len
        room = limit - len(ids)
        max_tokens = req.params.max_tokens if req.params.max_tokens is not None else room
        # A prompt that fills the context fits only when nothing is to be generated
        # (max_tokens 0: scoring the prompt).
        if room < (0 if req.params.max_tokens == 0 else 1) or max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens" if room >= 1 else "prompt",
            )
        return SequenceRequest(
            rid=req.rid,
            prompt_token_ids=tuple(ids),
            params=req.params,
            max_tokens=max_tokens,
            eos_token_ids=self.info.eos_token_ids,
            arrival_time=req.arrival_time,
        )

    def _chat(self, req: TokenizeRequest) -> list[int]:
        if not req.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if getattr(self.tok, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use completions", "messages")
        convo = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            out = self.tok.apply_chat_template(
                convo, add_generation_prompt=req.add_generation_prompt, tokenize=True
            )
        except Exception as exc:  # a template can raise anything (jinja's raise_exception)
            raise InvalidRequest(f"chat template failed: {exc}", "messages") from None
        # transformers 5 returns a BatchEncoding here; older versions a list.
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]


class Tokenizer:
    """The actor: one inbox, two outboxes."""

    def __init__(
        self,
        encoder: PromptEncoder,
        inbox: Inbox[TokenizerInput],
        scheduler: Outbox[SchedulerInput],
        frontend: Outbox[FrontendInput],
        tracer: Tracer | None = None,
    ) -> None:
        self.encoder = encoder
        self.inbox, self.scheduler, self.frontend = inbox, scheduler, frontend
        self.ledger = Ledger("tokenizer", tracer)

    async def run(self) -> None:
        async for msg in self.inbox:
            if isinstance(msg, AbortRequest):
                await self.scheduler.send(msg)
                continue
            try:
                seq = self.encoder.encode(msg)
            except InvalidRequest as exc:
                self.ledger.fire(msg.rid, "reject", reason=str(exc))
                self.ledger.drop(msg.rid)
                await self.frontend.send(RequestFailed(msg.rid, str(exc), "invalid_request",
                                                       exc.param))
                continue
            except Exception as exc:  # a tokenizer bug must not take the server down
                log.exception("tokenizing %s failed", msg.rid)
                self.ledger.fire(msg.rid, "reject", reason="internal")
                self.ledger.drop(msg.rid)
                await self.frontend.send(RequestFailed(msg.rid, f"tokenizer error: {exc}",
                                                       "internal"))
                continue
            await self.scheduler.send(seq)

    def drain_problems(self) -> list[str]:
        return [f"tokenizer ledger holds {sorted(self.ledger.views)}"] if len(self.ledger) else []
