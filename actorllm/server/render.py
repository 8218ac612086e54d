"""OpenAI's response shapes, built from engine outputs: pure functions of what arrived.

A renderer knows nothing of ASGI, sockets or the engine; ``generation.py`` feeds it each
``CompletionOutput`` as it comes and sends what it returns. A streamed chunk comes out
as SSE bytes (``add_event``): its envelope was encoded once for the response, so a chunk
costs its choice's encoding only. Each choice's outputs are
folded with the one merge of ``actorllm.wire.outputs``; what a renderer adds is the shape:
roles, chunks, logprobs in the chat or the legacy completions layout, usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from actorllm.server import sse
from actorllm.server.logprobs import (
    PromptOffsets,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from actorllm.server.reasoning import ReasoningParser, ReasoningStream
from actorllm.server.tool_stream import ToolStream
from actorllm.server.tools import ToolPlan
from actorllm.wire.messages import FinishReason
from actorllm.wire.outputs import CompletionOutput, Merged, RequestOutput, prompt_ids_of


class JobView(Protocol):
    """What a renderer reads of one engine request (``generation.Job``)."""

    index_base: int  # its choices are index_base + i in the response
    echo: str  # completions with echo: the text put before the choice's output
    echo_skips_special: bool


@attrs.define
class ChoiceState:
    """One choice, accumulated (for the whole response) and its streaming progress."""

    merged: Merged = attrs.Factory(Merged)  # the choice's outputs (with any echo) so far
    logprobs: list[Any] = attrs.Factory(list)  # chat: content entries
    completion_lps: dict[str, list[Any]] | None = None  # completions: the legacy lists
    offset: int = 0  # completions: text_offset of the next token
    started: bool = False
    # Prompt logprobs: the next position to render, the echo's offsets, and the
    # vLLM-shaped `prompt_logprobs` field so far.
    prompt_pos: int = 0
    prompt_offsets: PromptOffsets | None = None
    prompt_field: list[Any] = attrs.Factory(list)
    cum_logprob: float = 0.0  # of the sampled tokens (best_of ranks choices by it)

    @property
    def text(self) -> str:
        return "".join(self.merged.text)


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # prompt tokens the prefix cache served (OpenAI's field)
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class Renderer(Protocol):
    """Turns engine outputs into one endpoint's response shapes."""

    def prelude(self, firsts: Sequence[RequestOutput | None]) -> list[dict[str, Any]]:
        """The chunks that open a stream, sent before ``firsts`` (each job's first output,
        None for a job that had none) are rendered."""
        ...

    def add(self, job: JobView, out: CompletionOutput
            ) -> dict[str, Any] | list[dict[str, Any]] | None: ...

    def add_event(self, job: JobView, out: CompletionOutput) -> bytes | None: ...

    def final(self, usage: dict[str, int]) -> dict[str, Any]: ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any] | list[dict[str, Any]]: ...

    def completion_tokens(self) -> int: ...


class _RendererBase:
    chunk_object = ""  # the "object" of a streamed chunk

    def __init__(self, *, response_id: str, created: int, model: str, num_choices: int,
                 texts: TokenTexts, logprobs: bool, prompt_logprobs: int | None = None,
                 echo_logprobs: int | None = None, token_ids: bool = False) -> None:
        """``prompt_logprobs``: k of vLLM's ``prompt_logprobs`` field, None when not asked;
        ``echo_logprobs``: k for the echoed prompt in the legacy ``logprobs`` (completions);
        ``token_ids``: vLLM's ``return_token_ids`` (the engine sends the prompt's ids with
        a choice's first output)."""
        self.id, self.created, self.model = response_id, created, model
        self.texts, self.want_logprobs = texts, logprobs
        self.prompt_k, self.echo_k = prompt_logprobs, echo_logprobs
        self.want_ids = token_ids
        self.choices = {i: ChoiceState() for i in range(num_choices)}
        self._head, self._tail = sse.chunk_framing(
            {"id": self.id, "object": self.chunk_object, "created": self.created,
             "model": self.model})

    def _choice(self, job: JobView, out: CompletionOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def add(self, job: JobView, out: CompletionOutput) -> dict[str, Any] | None:
        """Fold ``out`` in; the chunk that tells the client of it (None: nothing yet)."""
        choice = self._choice(job, out)
        return None if choice is None else self._envelope(self.chunk_object, [choice])

    def add_event(self, job: JobView, out: CompletionOutput) -> bytes | None:
        """As :meth:`add`, the chunk as one SSE event (the same JSON as
        ``sse.event(add(...))``)."""
        choice = self._choice(job, out)
        return None if choice is None else self._head + sse.dumps(choice) + self._tail

    def _ids_news(self, out: CompletionOutput) -> bool:
        """Whether ``out`` has ids to tell under ``return_token_ids``."""
        return self.want_ids and bool(out.token_ids or out.prompt_token_ids)

    def completion_tokens(self) -> int:
        return sum(len(c.merged.token_ids) for c in self.choices.values())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _fold(self, st: ChoiceState, out: CompletionOutput, text: str) -> None:
        st.merged.add(out if text == out.text else attrs.evolve(out, text=text))

    def _prompt_field(self, st: ChoiceState, out: CompletionOutput) -> list[Any] | None:
        """This output's share of vLLM's ``prompt_logprobs`` (None if not asked)."""
        if self.prompt_k is None:
            return None
        piece = vllm_prompt_logprobs(self.texts, out.prompt_logprobs, self.prompt_k)
        st.prompt_field += piece
        return piece


class ChatRenderer(_RendererBase):
    """``chat.completion`` and ``chat.completion.chunk``; with ``tools`` (a plan whose
    mode is not ``none``) the text is read for tool calls (``server/tools.py``); with
    ``reasoning`` its reasoning part is ``reasoning_content`` and the rest is read as the
    answer (``server/reasoning.py``)."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *, tools: ToolPlan | None = None,
                 reasoning: ReasoningParser | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.tools, self.reasoning = tools, reasoning
        self._tool_streams: dict[int, ToolStream] = {}
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def prelude(self, firsts: Sequence[RequestOutput | None]) -> list[dict[str, Any]]:
        # OpenAI opens each choice with its role before any content; with tools, the
        # content is null until there is some (an answer of calls only has none). Under
        # return_token_ids the prompt's ids ride on the role chunks, where vLLM puts them
        # (each job's first output has brought them: a stream opens only then).
        opening = "" if self.tools is None else None
        ids = prompt_ids_of(o for r in firsts if r is not None for o in r.outputs) \
            if self.want_ids else ()
        root = {"prompt_token_ids": list(ids)} if ids else {}
        return [{**self._envelope("chat.completion.chunk", [{
            "index": i, "delta": {"role": "assistant", "content": opening}, "logprobs": None,
            "finish_reason": None}]), **root} for i in self.choices]

    def _choice(self, job: JobView, out: CompletionOutput) -> dict[str, Any] | None:
        index = job.index_base + out.index
        st = self.choices[index]
        self._fold(st, out, out.text)
        self._prompt_field(st, out)
        lps = chat_logprobs(self.texts, out.logprobs) if self.want_logprobs else []
        st.logprobs += lps
        text, thought = out.text, ""
        if self.reasoning is not None:
            rs = self._reasoning_streams.setdefault(index, self.reasoning.stream())
            thought, text = rs.feed(text, final=out.finish_reason is not None)
        delta: dict[str, Any] = {"content": text} if text else {}
        finish = out.finish_reason
        if self.tools is not None:
            delta, finish = self._tool_delta(index, text, finish)
        if thought:
            delta = {"reasoning_content": thought, **delta}
        if not delta and not lps and out.finish_reason is None and not self._ids_news(out):
            return None  # held-back text: nothing to tell the client yet
        choice: dict[str, Any] = {
            "index": index, "delta": delta,
            "logprobs": {"content": lps} if self.want_logprobs else None,
            "finish_reason": finish,
        }
        if out.finish_reason is not None:
            choice["stop_reason"] = out.stop_reason
        if self.want_ids:  # (the prompt's ids went on the role chunks: prelude)
            choice["token_ids"] = list(out.token_ids)
        return choice

    def _tool_delta(self, index: int, text: str,
                    finish: str | None) -> tuple[dict[str, Any], str | None]:
        assert self.tools is not None
        ts = self._tool_streams.setdefault(index, ToolStream(self.tools))
        content, calls = ts.feed(text)
        if finish is not None:
            rest, more = ts.finish()
            content, calls = content + rest, calls + more
            finish = _tool_finish(finish, ts.found)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, finish

    def _message(self, st: ChoiceState) -> tuple[dict[str, Any], str | None]:
        text: str | None = st.text
        thought: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(st.text)
            thought = {"reasoning_content": reasoning}
        if self.tools is None:
            return ({"role": "assistant", "content": text, **thought},
                    st.merged.finish_reason)
        content, calls = self.tools.message(text or "")
        message: dict[str, Any] = {"role": "assistant", "content": content, **thought}
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        return message, _tool_finish(st.merged.finish_reason, bool(calls))

    def final(self, usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, st in sorted(self.choices.items()):
            message, finish = self._message(st)
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": st.logprobs} if self.want_logprobs else None,
                "finish_reason": finish, "stop_reason": st.merged.stop_reason,
            })
            if self.want_ids:
                choices[-1]["token_ids"] = list(st.merged.token_ids)
        response = {**self._envelope("chat.completion", choices), "usage": usage}
        if self.prompt_k is not None:
            # vLLM puts them beside the choices: every choice has the same prompt.
            response["prompt_logprobs"] = self.choices[0].prompt_field
        if self.want_ids:
            response["prompt_token_ids"] = list(prompt_ids_of(
                st.merged for st in self.choices.values()))
        return response

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage}


def _tool_finish(finish: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` for an answer that ended by itself with calls."""
    if called and finish == FinishReason.STOP:
        return FinishReason.TOOL_CALLS
    return finish


class CompletionRenderer(_RendererBase):
    """``text_completion``, whole or streamed. ``best_of=(n, k)``: each prompt's ``k``
    choices are candidates, and the whole answer keeps the ``n`` with the highest
    cumulative logprob (vLLM's ``best_of``; never streamed)."""

    chunk_object = "text_completion"

    def __init__(self, *, best_of: tuple[int, int] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.best_of = best_of

    def prelude(self, firsts: Sequence[RequestOutput | None]) -> list[dict[str, Any]]:
        return []

    def _choice(self, job: JobView, out: CompletionOutput) -> dict[str, Any] | None:
        index = job.index_base + out.index
        st = self.choices[index]
        text = out.text
        st.cum_logprob += sum(lp.logprob for lp in out.logprobs)
        if not st.started:
            st.started = True
            text = job.echo + text
            st.offset = len(job.echo)
        self._fold(st, out, text)
        lps = None
        if self.want_logprobs:
            lps, st.offset = completion_logprobs(self.texts, out.logprobs, st.offset)
            if self.echo_k is not None and out.prompt_logprobs:
                # Prompt positions come before (or with) the first completion token.
                if st.prompt_offsets is None:
                    st.prompt_offsets = PromptOffsets(self.texts, limit=len(job.echo),
                                                      skip_special=job.echo_skips_special)
                echoed = echo_logprobs(self.texts, out.prompt_logprobs, st.merged.prompt_token_ids,
                                       st.prompt_pos, self.echo_k, st.prompt_offsets)
                st.prompt_pos += len(out.prompt_logprobs)
                lps = {k: echoed[k] + v for k, v in lps.items()}
            if st.completion_lps is None:
                st.completion_lps = {k: [] for k in lps}
            for k, v in lps.items():
                st.completion_lps[k] += v
        prompt_field = self._prompt_field(st, out)
        if not text and not out.logprobs and not out.prompt_logprobs \
                and out.finish_reason is None and not self._ids_news(out):
            return None
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": lps,
                                  "finish_reason": out.finish_reason}
        if prompt_field is not None:
            choice["prompt_logprobs"] = prompt_field
        if self.want_ids:  # vLLM's place: on the choice, the prompt's in its first chunk
            if out.prompt_token_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = list(out.token_ids)
        if out.finish_reason is not None:
            choice["stop_reason"] = out.stop_reason
        return choice

    def _kept(self) -> list[tuple[int, ChoiceState]]:
        """The choices the answer shows, in order (with best_of, the best of each prompt's)."""
        ordered = sorted(self.choices.items())
        if self.best_of is None:
            return ordered
        n, k = self.best_of
        kept: list[tuple[int, ChoiceState]] = []
        for p in range(0, len(ordered), k):
            group = sorted((st for _, st in ordered[p : p + k]),
                           key=lambda st: -st.cum_logprob)  # stable: ties keep their order
            kept += [(p // k * n + j, st) for j, st in enumerate(group[:n])]
        return kept

    def final(self, usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, st in self._kept():
            lps = None
            if self.want_logprobs:
                lps = st.completion_lps or {"tokens": [], "token_logprobs": [],
                                            "top_logprobs": [], "text_offset": []}
            choice = {"index": i, "text": st.text, "logprobs": lps,
                      "finish_reason": st.merged.finish_reason,
                      "stop_reason": st.merged.stop_reason}
            if self.prompt_k is not None:
                choice["prompt_logprobs"] = st.prompt_field
            if self.want_ids:
                choice["prompt_token_ids"] = list(st.merged.prompt_token_ids)
                choice["token_ids"] = list(st.merged.token_ids)
            choices.append(choice)
        return {**self._envelope("text_completion", choices), "usage": usage}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope("text_completion", []), "usage": usage}
