"""The Tokenizer actor: turns text or chat messages into validated token ids.

Owns nothing long-lived. Every ``GenerateRequest`` leaves as exactly one
``SequenceRequest`` (to the Scheduler) or one ``RequestFailed`` (to the Frontend).
``AbortRequest`` is forwarded to the Scheduler on the same FIFO edge as the
requests, so it always arrives after the request it cancels. With data parallelism
each message goes to the replica its ``replica`` field names (the Frontend's choice).

Tokenizing and templating run in a worker thread, not on the trio loop, unless the
input is short: a 1 MB prompt takes about a second to tokenize, and this actor shares
its loop with the HTTP server and the Frontend. HF fast tokenizers release the GIL and
may be shared by threads as long as nobody changes their truncation or padding, which
nothing in actorllm does. Short inputs stay inline because the thread hop costs more
than they do (and the simulation's delivery order stays the test's to choose).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import trio

from actorllm.config import ModelInfo
from actorllm.lifecycle.table import Ledger
from actorllm.lifecycle.trace import Tracer
from actorllm.text.structured import LLGuidanceBackend
from actorllm.tokenizer.direct import DirectEncoder
from actorllm.wire.mailbox import Inbox, Outbox, batches, send_soon
from actorllm.wire.messages import (
    AbortRequest,
    ChatMessage,
    FailureCode,
    FlowControl,
    FrontendInput,
    GenerateRequest,
    InvalidRequest,
    RequestFailed,
    SchedulerInput,
    SequenceRequest,
    TokenizerInput,
)

log = logging.getLogger(__name__)



# Inputs up to this many characters are tokenized on the loop (~1 µs a character).
INLINE_CHARS = 1024


def is_text(value: str) -> bool:
    """Whether ``value`` can be encoded as UTF-8 (JSON can carry a lone surrogate)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def input_chars(req: GenerateRequest) -> int:
    """How much text ``req`` gives the tokenizer (what decides inline or in a thread)."""
    if req.prompt is not None:
        return len(req.prompt)
    return sum(len(m.role) + len(m.content) for m in req.messages or ())


def truncated(ids: list[int], keep: int | None, limit: int) -> list[int]:
    """The prompt's last ``keep`` ids (vLLM's ``truncate_prompt_tokens``; -1: ``limit``,
    the context's length; None: all). A ``keep`` past the context is refused by name,
    as vLLM does: such a prompt would be refused anyway, but as too long."""
    if keep is None:
        return ids
    if keep > limit:
        raise InvalidRequest(f"truncate_prompt_tokens ({keep}) is more than the model's "
                             f"maximum context length ({limit})", "truncate_prompt_tokens")
    return ids[-(limit if keep == -1 else keep):]


def _json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: not JSON: {exc}", param) from None


class PromptEncoder:
    """Pure tokenization and validation; the actor below only moves messages."""

    def __init__(self, hf_tokenizer: Any, info: ModelInfo) -> None:
        self.tok = hf_tokenizer
        self.info = info
        self._grammars: LLGuidanceBackend | None = None  # built on the first grammar
        # Short inputs encoded keeping the GIL (tokenizer/direct.py): the loop of `single`
        # otherwise waits for the Worker's thread once per request.
        self.direct = DirectEncoder(hf_tokenizer, max_chars=2 * INLINE_CHARS)

    def encode(self, req: GenerateRequest) -> SequenceRequest:
        """Validate and tokenize; raises InvalidRequest with a clear message."""
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompt token ids or messages",
                                 "prompt")
        req.params.validate(self.info.vocab_size)
        if req.params.structured is not None:
            # Compiled here (and cached) so the Worker never meets a grammar that fails.
            if self._grammars is None:
                self._grammars = LLGuidanceBackend(self.tok, self.info.vocab_size,
                                                   self.info.eos_token_ids)
            self._grammars.check(req.params.structured)
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is not in the vocabulary "
                                     f"(size {self.info.vocab_size})", "prompt")
        else:
            tools = None if req.tools is None else _json(req.tools, "tools")
            extra = (None if req.template_kwargs is None
                     else _json(req.template_kwargs, "chat_template_kwargs"))
            ids = self.token_ids(req.prompt, req.messages, req.add_generation_prompt,
                                 tools=tools, template_kwargs=extra)
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        limit = self.info.max_model_len
        ids = truncated(ids, req.params.truncate_prompt_tokens, limit)
        room = limit - len(ids)
        max_tokens = req.params.max_tokens
        if max_tokens is None:  # the model's max_new_tokens, else the rest of the context
            default = self.info.sampling_defaults.get("max_tokens")
            max_tokens = min(room, int(default)) if isinstance(default, int) else room
        # A prompt that fills the context fits only when nothing is to be generated
        # (max_tokens 0: scoring the prompt).
        if room < (0 if req.params.max_tokens == 0 else 1):
            # The prompt alone fills the context: a completion budget would be negative.
            over = "more than the context holds" if room < 0 else \
                "which leaves no room for a completion"
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, the "
                f"prompt alone has {len(ids)} tokens, {over}. Please reduce the prompt.",
                "prompt")
        if max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return SequenceRequest(
            rid=req.rid,
            prompt_token_ids=tuple(ids),
            params=req.params,
            max_tokens=max_tokens,
            eos_token_ids=self.info.eos_token_ids,
            arrival_time=req.arrival_time,
            return_prompt_ids=req.return_prompt_ids,
        )

    def token_ids(self, prompt: str | None, messages: Sequence[ChatMessage] | None,
                  add_generation_prompt: bool = True, add_special_tokens: bool = True,
                  tools: list[Any] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The ids of a text prompt or of chat messages through the template
        (``template_kwargs``: further variables the template reads).

        The one place text becomes ids: the Tokenizer actor and ``POST /tokenize`` both
        call it, so they refuse the same inputs with the same messages.
        """
        if messages is not None:
            return self._chat(messages, add_generation_prompt, tools, template_kwargs)
        if not prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        if not is_text(prompt):
            raise InvalidRequest("prompt must be valid Unicode text (it holds a lone "
                                 "surrogate)", "prompt")
        ids = self.direct.text(prompt, add_special_tokens)
        if ids is not None:
            return ids
        return list(self.tok(prompt, add_special_tokens=add_special_tokens).input_ids)

    def _chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
              tools: list[Any] | None = None,
              template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if getattr(self.tok, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use completions", "messages")
        for i, m in enumerate(messages):
            if not (is_text(m.role) and is_text(m.content)):
                raise InvalidRequest("messages must be valid Unicode text (a lone surrogate "
                                     f"in message {i})", f"messages[{i}]")
        # `extra` (tool calls, tool_call_id) was made from a JSON object by the edge.
        convo = [{"role": m.role, "content": m.content,
                  **(_json(m.extra, f"messages[{i}]") if m.extra else {})}
                 for i, m in enumerate(messages)]
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            direct = self.direct.chat(convo, add_generation_prompt, **kwargs)
            if direct is not None:
                return direct
            out = self.tok.apply_chat_template(
                convo, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
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
        *,
        schedulers: Sequence[Outbox[SchedulerInput]] | None = None,
        inline_chars: int = INLINE_CHARS,
    ) -> None:
        """``inline_chars``: longer inputs are tokenized in a worker thread."""
        self.encoder = encoder
        self.inline_chars = inline_chars
        self.inbox, self.scheduler, self.frontend = inbox, scheduler, frontend
        # With data parallelism, one outbox per replica: each message goes to the replica
        # the Frontend chose for its rid (its ``replica`` field).
        self.schedulers = list(schedulers) if schedulers else [scheduler]
        self.ledger = Ledger("tokenizer", tracer)

    async def run(self) -> None:
        """Every message waiting is handled in one turn of the loop (wire/mailbox.py):
        a burst of requests reaches the Scheduler in one wake-up, not one per request,
        which under load made the last of 256 wait seconds for its first token."""
        async for msgs in batches(self.inbox):
            for msg in msgs:
                await self.handle(msg)

    async def handle(self, msg: TokenizerInput) -> None:
        """One message, in arrival order: the next waits until this one has left (an
        abort must never overtake the request it cancels, even one tokenized in a thread)."""
        if isinstance(msg, (AbortRequest, FlowControl)):
            await send_soon(self.schedulers[msg.replica], msg)
            return
        try:
            # A grammar's first compile may take milliseconds: never on the loop.
            if input_chars(msg) <= self.inline_chars and msg.params.structured is None:
                seq = self.encoder.encode(msg)
            else:
                seq = await self.off_loop(msg)
        except InvalidRequest as exc:
            self.ledger.fire(msg.rid, "reject", reason=str(exc))
            self.ledger.drop(msg.rid)
            await send_soon(self.frontend, RequestFailed(
                msg.rid, str(exc), FailureCode.INVALID_REQUEST, exc.param))
            return
        except Exception as exc:  # a tokenizer bug must not take the server down
            log.exception("tokenizing %s failed", msg.rid)
            self.ledger.fire(msg.rid, "reject", reason="internal")
            self.ledger.drop(msg.rid)
            await send_soon(self.frontend, RequestFailed(msg.rid, f"tokenizer error: {exc}",
                                                         FailureCode.INTERNAL))
            return
        await send_soon(self.schedulers[msg.replica], seq)

    async def off_loop(self, msg: GenerateRequest) -> SequenceRequest:
        """Encode ``msg`` in a worker thread (the simulation replaces this hop with one
        whose return it schedules)."""
        return await trio.to_thread.run_sync(self.encoder.encode, msg)

    def drain_problems(self) -> list[str]:
        return [f"tokenizer ledger holds {sorted(self.ledger.views)}"] if len(self.ledger) else []
