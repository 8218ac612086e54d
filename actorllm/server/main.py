"""``actorllm serve``: the engine and hypercorn's trio worker on one trio loop.

Order of start-up: check the port is free (fail fast, before minutes of loading), load
the model (``Resources``), start the actors, bind and listen, and only then print
``actorllm: serving NAME at http://HOST:PORT``.

Shutdown: SIGINT/SIGTERM starts a drain. The server keeps accepting connections and
answers 503 ``shutting_down`` to new requests (a client told so can go elsewhere; a
refused connection says nothing), lets in-flight requests finish for up to
``--drain-timeout`` seconds, then ends the rest with an error (an SSE error event and
``[DONE]``, or a 503 body; their engine requests are aborted through the Frontend),
and only then stops hypercorn and exits 0. A second signal stops at once. The drain waits
for responses still sending too (a slow reader's backlog), and at its deadline cuts every
write that waits on a client (``timeouts.py``): ``--drain-timeout`` bounds the whole
shutdown, not the clients' ``--stream-timeout``.

Engine death (a child process exits, an actor raises): every live request has already
failed with ``engine_dead`` (``AsyncEngine.mark_dead``). With ``--on-engine-death exit``
(the default) the server lets those answers go out, stops, and exits with
``EXIT_ENGINE_DEAD``, so that a supervisor restarts it; with ``stay`` it keeps
answering 503 ``engine_dead`` until signalled. With data parallelism and ``stay``, a
replica's death is not the engine's: only its requests fail, the others serve on, and
``engine.died`` is set only when the last replica dies (``AsyncEngine.lose_replica``).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import trio

from actorllm.config import EngineConfig, check_tensor_parallel_size
from actorllm.engine.heap import settle_heap
from actorllm.exit_codes import EXIT_USAGE, say_error
from actorllm.server.app import build_app
from actorllm.server.chunk_writer import KeepServerSend
from actorllm.server.features import Features, sentence_transformers_pooling
from actorllm.server.state import DEFAULT_MAX_PENDING

log = logging.getLogger(__name__)

EXIT_BIND = 1
EXIT_ENGINE_DEAD = 3
# After a shutdown has been decided, how long hypercorn may take to close connections.
_CLOSE_TIMEOUT = 2.0
# After an engine death, how long the failed requests get to send their answers.
_DEATH_GRACE = 5.0
# Connections the kernel queues before the server accepts them (capped by
# net.core.somaxconn). hypercorn's default, 100, overflowed when 256 clients connected at
# once to a busy loop: the kernel dropped the rest's SYNs, and TCP retried them 1, 3 and 7 s
# later, which the clients saw as time to first token (as uvicorn, vLLM's server, we
# queue 2048).
LISTEN_BACKLOG = 2048


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now, or None. (Racy, but catches the usual case.)"""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve --host {host}: {exc.strerror or exc}"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # The same option hypercorn sets, so a port in TIME_WAIT is not called busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            return _bind_message(host, port, exc)
    return None


def _bind_message(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {host}:{port}: the port is in use"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def served_name(config: EngineConfig, args: argparse.Namespace) -> str:
    """``--served-model-name``, else ``--model`` as given, else the embedded model's name."""
    if getattr(args, "served_model_name", None):
        return str(args.served_model_name)
    if getattr(args, "model", None):
        return str(args.model)
    return Path(config.model).name


def serve_main(config: EngineConfig, args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; the exit code of ``actorllm serve``."""
    from actorllm.engine.async_engine import Resources

    host, port = args.host, int(args.port)
    if not 0 <= port < 65536:
        say_error(f"--port must be in [0, 65535], got {port}")
        return EXIT_USAGE
    api_key = args.api_key or os.environ.get("ACTORLLM_API_KEY") or None
    problem = _check_port(host, port)
    if problem is not None:
        say_error(problem)
        return EXIT_BIND
    try:
        # Before any weights load, in this process whatever the topology.
        check_tensor_parallel_size(config.model, config.tensor_parallel_size)
        resources = Resources(config)
        features = _features(args, resources, config)
    except Exception as exc:  # torch, transformers and safetensors raise many kinds
        log.debug("loading %s failed", config.model, exc_info=True)
        say_error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return EXIT_USAGE
    options = _Options(
        host=host, port=port, api_key=api_key, name=served_name(config, args),
        drain_timeout=float(getattr(args, "drain_timeout", 10.0)),
        max_request_bytes=int(getattr(args, "max_request_bytes", 1 << 20)),
        max_pending=int(getattr(args, "max_pending", None) or DEFAULT_MAX_PENDING),
        on_engine_death=str(getattr(args, "on_engine_death", None) or "exit"),
        tool_call_parser=str(getattr(args, "tool_call_parser", None) or "json"),
        write_timeout=config.stream_timeout,
        body_timeout=float(getattr(args, "body_timeout", 30.0) or 0) or None,
        keep_alive_timeout=float(getattr(args, "keep_alive_timeout", 5.0) or 5.0),
        max_stream_hold=float(getattr(args, "max_stream_hold", 0.1)),
    )
    options.features = features
    return trio.run(_serve, config, resources, options)


def _features(args: argparse.Namespace, resources: Any, config: EngineConfig) -> Features:
    """The issue-31 settings; ``--chat-template`` replaces the loaded tokenizer's template
    (the Tokenizer actor and /tokenize render with that one tokenizer)."""
    template = getattr(args, "chat_template", None)
    if template is not None:
        resources.hf_tokenizer.chat_template = Path(template).read_text(encoding="utf-8")
    return Features.build(reasoning_parser=getattr(args, "reasoning_parser", None),
                          store_size=int(getattr(args, "responses_store_size", 1000)),
                          store_ttl=float(getattr(args, "responses_store_ttl", 3600.0)),
                          pooling=getattr(args, "pooling", None),
                          model_pooling=sentence_transformers_pooling(config.model),
                          tokenizer_info=bool(getattr(args, "enable_tokenizer_info_endpoint",
                                                      False)))


class _Options:
    def __init__(self, *, host: str, port: int, api_key: str | None, name: str,
                 drain_timeout: float, max_request_bytes: int, max_pending: int,
                 on_engine_death: str = "exit", tool_call_parser: str = "json",
                 write_timeout: float | None = None, body_timeout: float | None = None,
                 keep_alive_timeout: float = 5.0, max_stream_hold: float = 0.1) -> None:
        self.host, self.port, self.api_key, self.name = host, port, api_key, name
        self.drain_timeout, self.max_request_bytes = drain_timeout, max_request_bytes
        self.max_pending, self.on_engine_death = max_pending, on_engine_death
        self.tool_call_parser = tool_call_parser
        self.features = Features()
        # Client timeouts: a write the client does not take (--stream-timeout), a body
        # that does not arrive (--body-timeout), an idle keep-alive (--keep-alive-timeout).
        self.write_timeout, self.body_timeout = write_timeout, body_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.max_stream_hold = max_stream_hold  # server/pacing.py


def _hypercorn_config(opts: _Options, writes_cut: trio.Event | None = None) -> Any:
    from hypercorn.config import Config

    from actorllm.server import timeouts

    hc = Config()
    hc.bind = [_bind_address(opts.host, opts.port)]
    hc.backlog = LISTEN_BACKLOG
    # The drain happens before hypercorn is told to stop (see _drain): by then only
    # finished or failed responses and idle connections remain.
    hc.graceful_timeout = _CLOSE_TIMEOUT
    # Also bounds a client that sends its headers slowly: the connection is idle until they
    # are complete. (hypercorn's read_timeout is not used: it would cut every response
    # longer than it, the client sending nothing meanwhile.)
    hc.keep_alive_timeout = opts.keep_alive_timeout
    timeouts.set_write_timeout(hc, opts.write_timeout, cut=writes_cut)
    # Only HTTP/1.1 (server/protocol_errors.py says why): never offer h2 in ALPN.
    hc.alpn_protocols = ["http/1.1"]
    hc.accesslog = None
    # Through `logging`, so --log-level decides (hypercorn would print to stderr itself).
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


def _install_patches() -> None:
    """The methods of hypercorn and trio this server replaces (hypercorn_patch.py)."""
    from actorllm.server import accept, protocol_errors, timeouts

    protocol_errors.install()
    timeouts.install()
    accept.install()


async def _serve(config: EngineConfig, resources: Any, opts: _Options) -> int:
    from hypercorn.trio import serve

    from actorllm.engine.async_engine import open_engine

    _install_patches()

    exit_code = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_engine(config, resources=resources) as engine:
            app = build_app(engine, served_model_name=opts.name, api_key=opts.api_key,
                            max_request_bytes=opts.max_request_bytes,
                            max_pending=opts.max_pending, body_timeout=opts.body_timeout,
                            tool_call_parser=opts.tool_call_parser,
                            features=opts.features)
            state = app.state.server
            state.pacer.max_hold = opts.max_stream_hold
            shutdown = trio.Event()  # tells hypercorn to stop accepting and close
            # Set at the end of the drain: from then on a write the client does not take
            # is cut at once, so stalled readers cannot outlast --drain-timeout.
            writes_cut = trio.Event()

            async def on_signals(nursery: trio.Nursery) -> None:
                async for signum in signals:
                    if state.admission.open:
                        log.warning("%s: draining (up to %.1f s)",
                                    signal.Signals(signum).name, opts.drain_timeout)
                        state.admission.drain()
                        nursery.start_soon(_drain, state, opts.drain_timeout, shutdown,
                                           writes_cut)
                    else:
                        log.warning("second signal: stopping now")
                        writes_cut.set()
                        nursery.cancel_scope.cancel()
                        return

            async def on_death() -> None:
                nonlocal exit_code
                await engine.died.wait()
                exit_code = EXIT_ENGINE_DEAD
                if opts.on_engine_death != "exit":
                    log.error("the engine is dead; serving 503 engine_dead until signalled "
                              "(--on-engine-death stay)")
                    return
                log.error("the engine is dead; exiting with code %d once the failed "
                          "requests are answered (--on-engine-death exit)", EXIT_ENGINE_DEAD)
                with trio.move_on_after(_DEATH_GRACE):
                    await _until_idle(state)
                writes_cut.set()
                shutdown.set()

            started = False
            bind_error: OSError | None = None
            try:
                async with trio.open_nursery() as nursery:
                    async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
                        await serve(KeepServerSend(app), _hypercorn_config(opts, writes_cut),
                                    shutdown_trigger=shutdown.wait, task_status=task_status)
                        # hypercorn returns once drained: stop the signal watcher too.
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(on_signals, nursery)
                    nursery.start_soon(on_death)
                    nursery.start_soon(_watchdog, shutdown, writes_cut, nursery.cancel_scope)
                    binds = await nursery.start(run_http)
                    started = True
                    settle_heap()  # start-up's heap out of the collector's way
                    url = binds[0] if binds else f"http://{_bind_address(opts.host, opts.port)}"
                    sys.stdout.write(f"actorllm: serving {opts.name} at {url}\n")
                    sys.stdout.flush()
            except* OSError as group:
                if started:
                    raise
                first = group.exceptions[0]
                assert isinstance(first, OSError)
                bind_error = first
            if bind_error is not None:
                say_error(_bind_message(opts.host, opts.port, bind_error))
                return EXIT_BIND
    return exit_code


async def _until_idle(state: Any) -> None:
    """Until no HTTP request holds an engine sequence or still sends its answer."""
    while state.admission.held > 0 or state.responding > 0:
        await trio.sleep(0.02)


async def _drain(state: Any, drain_timeout: float, shutdown: trio.Event,
                 writes_cut: trio.Event | None = None) -> None:
    """Let in-flight requests finish for ``drain_timeout`` s, end the rest, then stop.

    At the deadline, writes that wait on clients that do not read are cut too
    (``writes_cut``): otherwise each would hold the process until its --stream-timeout.
    """
    with trio.move_on_after(max(drain_timeout, 0.0)):
        await _until_idle(state)
    if writes_cut is not None:
        writes_cut.set()
    if state.admission.held > 0 or state.responding > 0:
        log.warning("drain timeout: ending %d responses (%d sequences) with an error",
                    state.responding, state.admission.held)
        state.drain_expired.set()
        # Each one sends its error and aborts its engine requests; that takes a moment.
        with trio.move_on_after(_CLOSE_TIMEOUT):
            await _until_idle(state)
    shutdown.set()


async def _watchdog(shutdown: trio.Event, writes_cut: trio.Event,
                    cancel: trio.CancelScope) -> None:
    """Once hypercorn is told to stop, give it its close time (plus a margin), then stop."""
    await shutdown.wait()
    writes_cut.set()  # whatever way shutdown came, no write may hold it up
    await trio.sleep(_CLOSE_TIMEOUT + 5.0)
    log.warning("the server had not stopped %.0f s after shutdown; stopping now",
                _CLOSE_TIMEOUT + 5.0)
    cancel.cancel()
