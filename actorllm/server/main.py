"""``actorllm serve``: the engine and hypercorn's trio worker on one trio loop.

Order of start-up: check the port is free (fail fast, before minutes of loading), load
the model (``Resources``), start the actors, bind and listen, and only then print
``actorllm: serving NAME at http://HOST:PORT``. SIGINT/SIGTERM stops accepting, lets
in-flight requests finish for up to ``--drain-timeout`` seconds, aborts the rest (their
handlers are cancelled, which aborts them through the Frontend) and exits 0. A second
signal stops at once.
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

from actorllm.config import EngineConfig
from actorllm.server.app import DEFAULT_MAX_PENDING, build_app

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_BIND = 1


def _error(message: str) -> None:
    sys.stderr.write(f"actorllm: error: {message}\n")
    sys.stderr.flush()


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
    from actorllm.engine import Resources

    host, port = args.host, int(args.port)
    if not 0 <= port < 65536:
        _error(f"--port must be in [0, 65535], got {port}")
        return EXIT_USAGE
    api_key = args.api_key or os.environ.get("ACTORLLM_API_KEY") or None
    problem = _check_port(host, port)
    if problem is not None:
        _error(problem)
        return EXIT_BIND
    try:
        resources = Resources(config)
    except Exception as exc:  # torch, transformers and safetensors raise many kinds
        log.debug("loading %s failed", config.model, exc_info=True)
        _error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return EXIT_USAGE
    options = _Options(
        host=host, port=port, api_key=api_key, name=served_name(config, args),
        drain_timeout=float(getattr(args, "drain_timeout", 10.0)),
        max_request_bytes=int(getattr(args, "max_request_bytes", 1 << 20)),
        max_pending=int(getattr(args, "max_pending", None) or DEFAULT_MAX_PENDING),
    )
    return trio.run(_serve, config, resources, options)


class _Options:
    def __init__(self, *, host: str, port: int, api_key: str | None, name: str,
                 drain_timeout: float, max_request_bytes: int, max_pending: int) -> None:
        self.host, self.port, self.api_key, self.name = host, port, api_key, name
        self.drain_timeout, self.max_request_bytes = drain_timeout, max_request_bytes
        self.max_pending = max_pending


def _hypercorn_config(opts: _Options) -> Any:
    from hypercorn.config import Config

    hc = Config()
    hc.bind = [_bind_address(opts.host, opts.port)]
    hc.graceful_timeout = max(opts.drain_timeout, 0.0)
    hc.accesslog = None
    # Through `logging`, so --log-level decides (hypercorn would print to stderr itself).
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def _serve(config: EngineConfig, resources: Any, opts: _Options) -> int:
    from hypercorn.trio import serve

    from actorllm.engine import open_engine

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_engine(config, resources=resources) as engine:
            app = build_app(engine, served_model_name=opts.name, api_key=opts.api_key,
                            max_request_bytes=opts.max_request_bytes,
                            max_pending=opts.max_pending)
            state = app.state.server
            shutdown = trio.Event()

            async def on_signals(cancel: trio.CancelScope) -> None:
                async for signum in signals:
                    if not shutdown.is_set():
                        log.warning("%s: draining (up to %.1f s)",
                                    signal.Signals(signum).name, opts.drain_timeout)
                        state.draining = True
                        shutdown.set()
                    else:
                        log.warning("second signal: stopping now")
                        cancel.cancel()
                        return

            started = False
            bind_error: OSError | None = None
            try:
                async with trio.open_nursery() as nursery:

                    async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
                        await serve(app, _hypercorn_config(opts), shutdown_trigger=shutdown.wait,
                                    task_status=task_status)
                        # hypercorn returns once drained: stop the signal watcher too.
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(on_signals, nursery.cancel_scope)
                    nursery.start_soon(_watchdog, shutdown, nursery.cancel_scope,
                                       opts.drain_timeout)
                    binds = await nursery.start(run_http)
                    started = True
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
                _error(_bind_message(opts.host, opts.port, bind_error))
                return EXIT_BIND
    return 0


async def _watchdog(shutdown: trio.Event, cancel: trio.CancelScope,
                    drain_timeout: float) -> None:
    """After a shutdown signal, give hypercorn the drain time (plus a margin), then stop."""
    await shutdown.wait()
    await trio.sleep(max(drain_timeout, 0.0) + 5.0)
    log.warning("the server had not stopped 5 s after the drain timeout; stopping now")
    cancel.cancel()
