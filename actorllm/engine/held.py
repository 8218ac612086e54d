"""An engine held open across synchronous calls, on a trio loop in a thread of its own.

``LLM`` is a synchronous API, but an engine is a set of trio actors (and, in the
``engine`` and ``pipeline`` topologies, child processes that load the weights). Opened
per call under ``trio.run``, a multi-process engine paid its start-up on every
``generate`` (4.5-4.8 s on the near-zero model, stop 54). vLLM's ``LLM`` keeps its engine
core for the object's life; :class:`HeldEngine` does the same here. It owns one thread
that runs a trio loop; the engine lives in that loop's nursery from the first call until
:meth:`HeldEngine.close`. A caller's thread hands a coroutine to the loop and waits on a
queue for what it sends back, so the caller's own callbacks run on the caller's thread.

What the caller's thread may meet while it waits:

- an exception of its own (Ctrl-C, or its callback raising): the call's cancel scope is
  cancelled on the loop, which aborts the call's requests (``AsyncEngine.generate``
  aborts what it leaves unfinished) and frees their KV blocks; the caller waits for that
  and re-raises. The engine stays open for the next call.
- a dead engine (a child process exited, an actor raised): the requests in flight fail
  with ``engine_dead`` as in any topology; the next call opens a new engine.

The children are spawned from this thread (``topology/children.spawn`` forks in the trio
thread), so their parent-death signal fires when it ends, which is when the engine is
closed or the process dies.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from actorllm.config import EngineConfig
from actorllm.engine.async_engine import AsyncEngine, open_engine
from actorllm.engine.resources import Resources

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a call's queue carries: ("item", x) for the caller's callback, then
# ("done", (True, result)) or ("done", (False, exception)).
_ITEM, _DONE = "item", "done"


class HeldEngine:
    """One engine of ``config``, opened at the first :meth:`call` and held until
    :meth:`close`, on a trio loop in a daemon thread this object owns."""

    def __init__(self, config: EngineConfig, resources: Resources) -> None:
        self._config = config
        self._resources = resources
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._engine: AsyncEngine | None = None
        self._release: trio.Event | None = None  # set: the holder closes its engine
        self._released: trio.Event | None = None  # set: the holder's engine is closed
        self._calls: set[trio.CancelScope] = set()
        self._no_calls: trio.Event | None = None  # set when the last call has left (close)
        self._lock: trio.Lock | None = None
        self._closed = False
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,),
                                        name="actorllm-engine-loop", daemon=True)
        self._thread.start()
        ready.wait()

    # --- the caller's side ---------------------------------------------------------------

    def call(self, fn: Callable[[AsyncEngine, Callable[[Any], None]], Awaitable[T]],
             on_item: Callable[[Any], None] | None = None) -> T:
        """Run ``await fn(engine, send)`` on the loop with the engine open and return its
        result; ``send(x)`` from the loop calls ``on_item(x)`` on this thread. Raises what
        ``fn`` raises, and ``EngineStartError`` if the engine cannot open. Any exception
        met here while waiting (Ctrl-C, ``on_item`` raising) cancels the call first."""
        if self._closed or self._token is None:
            raise RuntimeError("this engine is closed")
        box: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        scope = trio.CancelScope()
        try:
            trio.from_thread.run_sync(self._start_call, fn, box, scope, trio_token=self._token)
        except trio.RunFinishedError:
            raise RuntimeError("this engine is closed") from None
        try:
            while True:
                kind, value = box.get()
                if kind == _DONE:
                    break
                if on_item is not None:
                    on_item(value)
        except BaseException:
            self._cancel(scope)
            while box.get()[0] != _DONE:  # its requests are aborted once this comes
                pass
            raise
        ok, result = value
        if not ok:
            raise result
        return result  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the engine (and its child processes) and the loop; idempotent. Safe from
        a finalizer: on the loop's own thread it only asks the loop to stop."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is self._thread:
            self._shut()  # (a finalizer run by the loop itself: it cannot wait for itself)
            return
        if self._token is not None:
            try:
                trio.from_thread.run_sync(self._shut, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()

    def _cancel(self, scope: trio.CancelScope) -> None:
        assert self._token is not None
        try:
            trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
        except trio.RunFinishedError:
            pass

    # --- the loop's side -----------------------------------------------------------------

    def _main(self, ready: threading.Event) -> None:
        try:
            trio.run(self._serve, ready)
        except BaseException:
            log.exception("the engine's loop failed")
        finally:
            ready.set()  # (if it failed before it was ready, call() finds no token)

    async def _serve(self, ready: threading.Event) -> None:
        self._lock = trio.Lock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            ready.set()
            await trio.sleep_forever()

    def _start_call(self, fn: Callable[..., Awaitable[Any]],
                    box: queue.SimpleQueue[tuple[str, Any]], scope: trio.CancelScope) -> None:
        assert self._nursery is not None
        self._calls.add(scope)
        self._nursery.start_soon(self._run_call, fn, box, scope)

    async def _run_call(self, fn: Callable[..., Awaitable[Any]],
                        box: queue.SimpleQueue[tuple[str, Any]], scope: trio.CancelScope) -> None:
        result: tuple[bool, Any] = (False, RuntimeError("the call was cancelled"))
        try:
            with scope:
                engine = await self._open()
                result = (True, await fn(engine, lambda x: box.put((_ITEM, x))))
        except Exception as exc:  # the caller's to see; the loop serves on
            result = (False, exc)
        finally:
            self._calls.discard(scope)
            if not self._calls and self._no_calls is not None:
                self._no_calls.set()
            box.put((_DONE, result))

    async def _open(self) -> AsyncEngine:
        """The held engine; a new one if there is none yet or the last one died."""
        assert self._lock is not None and self._nursery is not None
        async with self._lock:
            if self._engine is not None and not self._engine.alive:
                log.warning("the engine died (%s); opening a new one",
                            self._engine.dead_reason)
                await self._drop()
            if self._engine is None:
                self._release, self._released = trio.Event(), trio.Event()
                self._engine = await self._nursery.start(self._hold, self._release,
                                                         self._released)
            return self._engine

    async def _hold(self, release: trio.Event, released: trio.Event,
                    task_status: trio.TaskStatus[AsyncEngine] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Keep one engine open until ``release``; an error while it is open fails its
        requests (as a death does) instead of ending the loop."""
        engine: AsyncEngine | None = None
        try:
            async with open_engine(self._config, resources=self._resources,
                                   handle_sigterm=False) as engine:
                task_status.started(engine)
                await release.wait()
        except Exception as exc:
            if engine is None:
                raise  # (nursery.start raises it to the call that opened the engine)
            log.exception("the engine failed")
            engine.mark_dead(f"the engine failed: {type(exc).__name__}: {exc}")
        finally:
            released.set()

    async def _drop(self) -> None:
        """Close the held engine and wait until it is closed."""
        if self._engine is None:
            return
        assert self._release is not None and self._released is not None
        self._release.set()
        await self._released.wait()
        self._engine = None

    def _shut(self) -> None:
        """Cancel the calls, close the engine, end the loop (``close``)."""
        for scope in list(self._calls):
            scope.cancel()
        assert self._nursery is not None
        self._nursery.start_soon(self._shut_down, self._nursery)

    async def _shut_down(self, nursery: trio.Nursery) -> None:
        while self._calls:  # each aborts its requests, shielded, and leaves
            self._no_calls = trio.Event()
            await self._no_calls.wait()
        await self._drop()
        nursery.cancel_scope.cancel()
