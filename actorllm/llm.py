"""``LLM``: the synchronous Python API, like vLLM's offline ``LLM.generate``.

The weights and the tokenizer are loaded once, in ``LLM(...)``. The first ``generate``
opens the engine (its actors and, in the ``engine`` and ``pipeline`` topologies, its
child processes) on a trio loop of the ``LLM``'s own (:class:`HeldEngine`), which keeps
it open until ``close()``, the end of a ``with`` block, or the object's collection, as
vLLM's ``LLM`` keeps its engine core. Each call submits its prompts there (a chunk a
turn of the event loop; continuous batching does the rest) and returns when all are done.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any

import attrs
import trio

from actorllm.config import EngineConfig, default_model_dir
from actorllm.embed import EmbeddingResult, embedded, embedding_params
from actorllm.engine.async_engine import AsyncEngine, Resources
from actorllm.engine.heap import frozen_heap
from actorllm.engine.held import HeldEngine
from actorllm.hub import resolve_model
from actorllm.wire.messages import ChatMessage, GenerateRequest, SamplingParams
from actorllm.wire.outputs import CompletionOutput, Merged, RequestError, merge_all, prompt_ids_of
from actorllm.wire.sampling import resolve_sampling


@attrs.frozen
class Conversation:
    """A chat prompt (``LLM.chat``): messages the model's chat template renders."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    template_kwargs: str | None = None  # a JSON object of further template variables
    tools: str | None = None  # a JSON list of tool definitions for the template


Prompt = str | Sequence[int] | Sequence[ChatMessage] | Conversation

# The length when neither the caller nor the model names one (vLLM's LLM, OpenAI's 16).
LLM_MAX_TOKENS = 16

# Prompts submitted between two turns of the event loop. All at once, the first reached
# the Scheduler only once the last had gone through the Frontend and the Tokenizer (trio
# runs every task a turn has made runnable before the ones they wake): 256 prompts of 128
# tokens took ~25 ms before the first step could start. In turns, the first chunk's
# prefill runs while the rest are submitted.
SUBMIT_CHUNK = 16


@attrs.frozen
class GenerationResult:
    """One prompt's whole result: every choice, accumulated, or the error it met."""

    rid: str
    prompt: Prompt
    outputs: tuple[CompletionOutput, ...]
    num_prompt_tokens: int
    error: str | None = None
    prompt_token_ids: tuple[int, ...] = ()  # () if it failed before the Scheduler had it
    pooled: tuple[float, ...] = ()  # a pooling request's vector (``LLM.embed``'s)

    @property
    def request_id(self) -> str:
        """vLLM's name for ``rid``."""
        return self.rid

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: a result here is always whole."""
        return True

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": sum(len(o.token_ids) for o in self.outputs)}


def make_request(rid: str, prompt: Prompt, params: SamplingParams, *,
                 return_prompt_ids: bool = False) -> GenerateRequest:
    """Text, token ids, chat messages or a Conversation -> a GenerateRequest."""
    form: dict[str, Any]
    if isinstance(prompt, str):
        form = {"prompt": prompt}
    elif isinstance(prompt, Conversation):
        form = {"messages": prompt.messages, "tools": prompt.tools,
                "add_generation_prompt": prompt.add_generation_prompt,
                "template_kwargs": prompt.template_kwargs}
    elif (items := list(prompt)) and isinstance(items[0], ChatMessage):
        form = {"messages": tuple(items)}
    else:
        form = {"prompt_token_ids": tuple(map(int, items))}
    return GenerateRequest(rid, params, return_prompt_ids=return_prompt_ids, **form)


async def collect(engine: AsyncEngine, rid: str, prompt: Prompt,
                  params: SamplingParams, *, final_only: bool = True) -> GenerationResult:
    """Run one prompt to the end and return its accumulated result (``final_only``: the
    engine wakes this task once, at the end, not once per step)."""
    choices: dict[int, Merged] = {}
    n_prompt = 0
    pooled: tuple[float, ...] = ()
    error: str | None = None
    try:
        async for out in engine.generate(make_request(rid, prompt, params,
                                                      return_prompt_ids=True),
                                         final_only=final_only):
            merge_all(choices, out)
            n_prompt = out.num_prompt_tokens or n_prompt
            pooled = out.pooled or pooled
    except RequestError as exc:
        error = str(exc)
    outputs = tuple(choices[i].output(i) for i in sorted(choices))
    return GenerationResult(rid, prompt, outputs, n_prompt, error=error,
                            prompt_token_ids=prompt_ids_of(choices.values()), pooled=pooled)


class LLM:
    """Offline batched generation. ``LLM(model=DIR).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | None = None, *, revision: str | None = None,
                 **engine_args: Any) -> None:
        """``model``: a directory or a hub id ``ORG/NAME`` (at ``revision``; see
        :mod:`actorllm.hub`); None: the embedded model."""
        path = resolve_model(str(model), revision) if model else str(default_model_dir())
        self.config = EngineConfig(model=path, **engine_args)
        self.resources = Resources(self.config)
        self._held: HeldEngine | None = None  # opened by the first generate
        self._closer: weakref.finalize | None = None
        self._calls = itertools.count()
        self._opening = threading.Lock()  # (two threads' first calls open one engine)

    def close(self) -> None:
        """Stop the engine and its child processes; a later ``generate`` opens it again.
        Also done when the ``LLM`` is collected or the interpreter exits."""
        with self._opening:
            if self._closer is not None:
                self._closer()  # (a finalize runs its function once)
            self._held = self._closer = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _engine(self) -> HeldEngine:
        with self._opening:
            if self._held is None:
                self._held = HeldEngine(self.config, self.resources)
                # Holds the HeldEngine, not this object, so the LLM can still be collected.
                self._closer = weakref.finalize(self, self._held.close)
            return self._held

    @property
    def tokenizer(self) -> Any:
        return self.resources.hf_tokenizer

    def get_tokenizer(self) -> Any:
        """vLLM's name for :attr:`tokenizer` (the model's transformers tokenizer)."""
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams: the model's
        generation_config.json defaults (as the CLI and HTTP take them), else the class's."""
        return resolve_sampling({}, self.resources.info.sampling_defaults,
                                max_tokens=LLM_MAX_TOKENS)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_done: Callable[[GenerationResult], None] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt concurrently; results come back in prompt order.

        Without ``sampling_params``, :meth:`default_sampling_params` (the model's defaults).
        ``on_done(result)`` runs on this thread as each prompt finishes. An exception
        here meanwhile (Ctrl-C, ``on_done`` raising) aborts the call's requests before
        it propagates; the engine stays open. Raises ``EngineStartError`` if the engine
        cannot start. ``use_tqdm``: a progress bar of finished prompts on stderr (vLLM's
        flag; there it is on by default, here off), drawn with rich as ``actorllm run``'s.
        """
        if isinstance(prompts, str | Mapping | Conversation) or (
                prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = [_unwrap(i, p) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(prompt_list):
            raise ValueError("give one SamplingParams, or one per prompt")
        call = next(self._calls)  # (request ids stay unique across calls, and threads)
        with contextlib.ExitStack() as stack:
            if use_tqdm:
                on_done = stack.enter_context(progress_bar(len(prompt_list), on_done))
            stack.enter_context(frozen_heap())  # actorllm/engine/heap.py
            return self._engine().call(
                partial(_generate, call, prompt_list, params_list, on_done is not None),
                on_done)

    def embed(self, prompts: Prompt | Sequence[Prompt], *, pooling: str | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
              ) -> list[EmbeddingResult]:
        """vLLM's ``LLM.embed``: each prompt's pooled final hidden state, as ``/v1/embeddings``
        gives it (``pooling``: ``last``, ``mean`` or ``cls``; default: the model's
        sentence-transformers config, else the last token; ``truncate_prompt_tokens``: of
        each prompt's last k tokens only)."""
        params, normalize = embedding_params(self.config.model, pooling, truncate_prompt_tokens)
        return [embedded(r, normalize) for r in self.generate(prompts, params,  # type: ignore[arg-type]
                                                              use_tqdm=use_tqdm)]

    def chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]]
        | Sequence[Sequence[ChatMessage | Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        on_done: Callable[[GenerationResult], None] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages: OpenAI-style dicts
        or ChatMessages) or a list of them, each rendered by the model's chat template and
        generated for as :meth:`generate` does. ``chat_template_kwargs``: further template
        variables (``enable_thinking``, ...); ``tools``: OpenAI tool definitions the
        template renders (the calls in the output are the caller's to read, as in
        vLLM's). Either is refused if the template does not read it. Raises ValueError
        naming a bad message, tool or variable."""
        from actorllm.server.chat_request import template_kwargs

        if isinstance(messages, str | bytes | Mapping | ChatMessage):
            raise ValueError("messages is a list of messages (or a list of such lists)")
        if not messages:
            raise ValueError("messages must not be empty")
        first = messages[0]
        one = isinstance(first, ChatMessage | Mapping)
        talks = [messages] if one else list(messages)
        template = getattr(self.tokenizer, "chat_template", None)
        kwargs = template_kwargs(dict(chat_template_kwargs) if chat_template_kwargs else None,
                                 template)
        tools_json = _tools(tools, template) if tools else None
        prompts = [Conversation(conversation(t), add_generation_prompt,  # type: ignore[arg-type]
                                kwargs, tools_json)
                   for t in talks]
        return self.generate(prompts, sampling_params, on_done=on_done, use_tqdm=use_tqdm)


def conversation(messages: Sequence[ChatMessage | Mapping[str, Any]]) -> tuple[ChatMessage, ...]:
    """One conversation's messages, each a ChatMessage or an OpenAI-style dict (``role``,
    ``content`` as text or text parts, ``name``, ``tool_calls``, ``tool_call_id``), checked
    as the HTTP server checks them. Raises ValueError naming the message and its field."""
    from pydantic import ValidationError

    from actorllm.server.convert import chat_messages
    from actorllm.server.schemas import ChatMessageIn

    if isinstance(messages, str | bytes) or not messages:
        raise ValueError("a conversation is a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            out.append(m)
            continue
        try:
            (msg,) = chat_messages([ChatMessageIn.model_validate(m)])
        except ValidationError as exc:
            raise _named(f"messages[{i}]", exc) from None
        except ValueError as exc:  # (InvalidRequest)
            raise ValueError(f"messages[{i}]: {exc}") from None
        out.append(msg)
    return tuple(out)


def _named(where: str, exc: Any) -> ValueError:
    """A pydantic ValidationError as one line naming the field as the HTTP server names
    it: ``where.field: why``."""
    from actorllm.server.errors import telling_error

    err, field = telling_error(exc.errors())
    path = where if field is None else f"{where}.{field}"
    return ValueError(f"{path}: {err.get('msg', 'invalid value')}")


def _tools(tools: Sequence[Mapping[str, Any]], template: Any) -> str:
    """OpenAI tool definitions, checked as the server checks them, as the template's JSON."""
    from pydantic import ValidationError

    from actorllm.server.chat_request import template_variables
    from actorllm.server.schemas import ToolDef
    from actorllm.server.tools import template_tools

    known = template_variables(template) if isinstance(template, str) else None
    if known is not None and "tools" not in known:
        raise ValueError("tools: the chat template does not read tools")
    defs = []
    for i, t in enumerate(tools):
        try:
            defs.append(ToolDef.model_validate(t))
        except ValidationError as exc:
            raise _named(f"tools[{i}]", exc) from None
    return template_tools(defs)


def _unwrap(i: int, prompt: Any) -> Prompt:
    """A prompt checked, and vLLM's dict prompts (``{"prompt": text}``,
    ``{"prompt_token_ids": ids}``) as the text or ids they hold; a key this does not
    honour is refused by name."""
    if isinstance(prompt, str | Conversation):
        return prompt
    if not isinstance(prompt, Mapping):
        if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], ChatMessage):
            return prompt  # type: ignore[return-value]
        return _token_ids(f"prompts[{i}]", prompt)
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"prompts[{i}]: {', '.join(map(repr, unknown))} is not supported "
                         "(only 'prompt' or 'prompt_token_ids')")
    if len(prompt) != 1:
        raise ValueError(f"prompts[{i}]: give one of 'prompt' and 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompts[{i}]: 'prompt' must be text")
        return str(prompt["prompt"])
    return _token_ids(f"prompts[{i}].prompt_token_ids", prompt["prompt_token_ids"])


def _token_ids(where: str, ids: Any) -> list[int]:
    """A prompt of token ids, each an int (not a bool, not a float: none is rounded)."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise ValueError(f"{where}: a prompt is text, a list of token ids, a dict or "
                         f"messages, not {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise ValueError(f"{where}: a list of token ids must not be empty")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{where}[{j}]: a token id is an int, not {type(t).__name__}")
    return [int(t) for t in ids]


@contextlib.contextmanager
def progress_bar(total: int, then: Callable[[GenerationResult], None] | None = None
                 ) -> Iterator[Callable[[GenerationResult], None]]:
    """An ``on_done`` that moves a progress bar of ``total`` prompts on stderr, then calls
    ``then`` (``LLM.generate(use_tqdm=True)``, ``actorllm run`` with several prompts)."""
    from rich.console import Console
    from rich.progress import Progress

    with Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("generating", total=total)

        def done(result: GenerationResult) -> None:
            bar.advance(task)
            if then is not None:
                then(result)

        yield done


async def _generate(call: int, prompts: list[Prompt], params: list[SamplingParams],
                    report: bool, engine: AsyncEngine, send: Callable[[Any], None]
                    ) -> list[GenerationResult]:
    """One ``generate`` call, on the engine's loop; ``send``s each result as it finishes
    when the caller has an ``on_done``."""
    results: list[GenerationResult | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        res = await collect(engine, f"llm-{call}-{i}", prompts[i], params[i])
        results[i] = res
        if report:
            send(res)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
            if i % SUBMIT_CHUNK == SUBMIT_CHUNK - 1:
                await trio.sleep(0)  # (see SUBMIT_CHUNK)
    return [r for r in results if r is not None]
