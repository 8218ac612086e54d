"""The ``actorllm`` command: ``run``, ``serve``, ``replay``, ``rank`` and ``replica``.

Start-up matters here: torch and transformers are imported only by the commands
that need them, so ``actorllm --help`` answers at once. Errors in flags, models or
files print one line (``actorllm: error: ...``) and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from actorllm.cli_checks import flag_error

EXIT_USAGE = 2


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="model directory (default: the embedded model)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks (default: from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, metavar="BYTES")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: requests' `priority` field orders them (lower first)")
    g.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "cuda"], default="auto")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads in the Worker's process (default: one per core; with "
                        "--topology engine or pipeline, or under `serve`, one per core less "
                        "one, left to the event loop that serves HTTP, but all of them for "
                        "prefill-sized steps); per rank with --tensor-parallel-size "
                        "(default: cores / N)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N processes (torch.distributed: gloo on the "
                        "CPU, NCCL on CUDA); N must divide the attention heads")
    g.add_argument("--tensor-parallel-local-ranks", type=int, default=None, metavar="K",
                   help="ranks 0..K-1 run on this host; K..N-1 join from other hosts "
                        "(`actorllm rank`) at MASTER_ADDR:MASTER_PORT (default: all local)")
    g.add_argument("--tensor-parallel-timeout", type=float, default=300.0, metavar="S",
                   help="how long every rank gets to join and load its shard (default 300)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan the next step while one runs, feeding each sampled token "
                        "forward in the Worker (default: on for CUDA; on the CPU, on for "
                        "`serve` in the single topology, off otherwise)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N replicas of the Scheduler and Worker, each in its own process, "
                        "behind one HTTP front (needs --topology engine, the default then)")
    g.add_argument("--data-parallel-local-replicas", type=int, default=None, metavar="K",
                   help="replicas 0..K-1 run here; K..N-1 join from other hosts "
                        "(`actorllm replica`) at MASTER_ADDR:MASTER_PORT (default: all here)")
    g.add_argument("--data-parallel-timeout", type=float, default=300.0, metavar="S",
                   help="how long every replica gets to join and load (default 300)")
    g.add_argument("--topology", choices=["single", "engine", "pipeline"], default=None,
                   help="where the actors run (default: single; engine with "
                        "--data-parallel-size above 1)")
    g.add_argument("--trace", metavar="FILE", help="write every state transition as JSON lines")
    g.add_argument("--trace-hops", action="store_true", help="with --trace: every mailbox hop too")
    g.add_argument("--log-level", default="WARNING")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="actorllm",
        description="An LLM inference server whose request lifecycle is explicit.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate for prompts on the command line")
    run.add_argument("prompts", nargs="*", metavar="PROMPT")
    run.add_argument("--prompts-file", type=Path, help="one prompt per line")
    run.add_argument("--max-tokens", type=int, default=None)
    run.add_argument("--temperature", type=float, default=None)
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--min-p", type=float, default=None)
    run.add_argument("--repetition-penalty", type=float, default=None)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--n", type=int, default=1)
    run.add_argument("--stop", action="append", default=[], metavar="S")
    run.add_argument("--ignore-eos", action="store_true")
    run.add_argument("--output", choices=["text", "jsonl"], default="text")
    _engine_flags(run)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="or ACTORLLM_API_KEY")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--drain-timeout", type=float, default=10.0)
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20)
    serve.add_argument("--max-pending", type=int, default=1024,
                       help="live sequences before new requests get 503")
    serve.add_argument("--tool-call-parser", choices=["json", "hermes"], default="json",
                       help="how the model writes tool calls: json (the embedded model's "
                       "template) or hermes (<tool_call>{...}</tool_call>)")
    serve.add_argument("--on-engine-death", choices=["exit", "stay"], default="exit",
                       help="when the engine dies: fail in-flight requests, then exit with "
                       "code 3 (exit, for a supervisor to restart) or keep answering 503; "
                       "with --data-parallel-size, stay fails only a dead replica's requests "
                       "and serves on with the others")
    _slow_client_flags(serve)
    _engine_flags(serve)

    replay = sub.add_parser("replay", help="check a trace against the spec")
    replay.add_argument("file", type=Path)
    replay.add_argument("--timeline", type=Path, help="OUT.html or OUT.png")
    replay.add_argument("--redrive", action="store_true",
                        help="re-run the Scheduler on the recorded inputs")
    replay.add_argument("--json", action="store_true", help="machine-readable report")

    rank = _joiner(sub, "rank", "a tensor-parallel rank", "the driver", "one per core")
    rank.add_argument("--watch-stdin", action="store_true", help=argparse.SUPPRESS)
    _joiner(sub, "replica", "a data-parallel replica", "the main host",
            "one per core less one")
    return parser


def _joiner(sub: Any, name: str, what: str, peer: str, threads: str) -> Any:
    """The subcommand of a process that joins ``peer`` on another host."""
    p = sub.add_parser(name, help=f"{what} for {peer} on another host (MASTER_ADDR, "
                       "MASTER_PORT, RANK, WORLD_SIZE from the env)")
    p.add_argument("--model", help=f"this host's copy of the model (default: {peer}'s path)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help=f"how long to wait for {peer} to answer")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help=f"torch threads of this {name} (default: {threads})")
    p.add_argument("--log-level", default="WARNING")
    return p


def _slow_client_flags(p: argparse.ArgumentParser) -> None:
    """Bounds on slow and stalled clients (docs/architecture.md, "Slow readers"); 0: off."""
    g = p.add_argument_group("slow clients (0 turns a limit off)")
    g.add_argument("--max-pending-bytes-per-request", type=int, default=256 << 10,
                   metavar="BYTES", help="unread output of one request before it is paused")
    g.add_argument("--max-pending-bytes", type=int, default=64 << 20, metavar="BYTES",
                   help="unread output of all requests before behind readers are paused "
                   "and new requests get 503")
    g.add_argument("--stream-timeout", type=float, default=30.0, metavar="S",
                   help="cancel a request whose client reads nothing for this long")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="408 when a request body has not fully arrived after this long")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="close an idle connection (or unfinished headers) after this long")


def _flow_args(args: argparse.Namespace) -> dict[str, Any]:
    """The slow-client flags EngineConfig takes (``actorllm serve`` only; 0 means None)."""
    names = ("max_pending_bytes_per_request", "max_pending_bytes", "stream_timeout")
    return {n: getattr(args, n) or None for n in names if hasattr(args, n)}


def engine_config(args: argparse.Namespace) -> Any:
    from actorllm.config import EngineConfig, default_model_dir

    try:
        return EngineConfig(
            model=args.model or str(default_model_dir()),
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            device=args.device,
            dtype=args.dtype,
            cpu_threads=args.cpu_threads,
            serving_http=args.command == "serve",
            tensor_parallel_size=args.tensor_parallel_size,
            tensor_parallel_local_ranks=args.tensor_parallel_local_ranks,
            tensor_parallel_timeout=args.tensor_parallel_timeout,
            async_scheduling=args.async_scheduling,
            data_parallel_size=args.data_parallel_size,
            data_parallel_local_replicas=args.data_parallel_local_replicas,
            data_parallel_timeout=args.data_parallel_timeout,
            topology=args.topology or ("engine" if args.data_parallel_size > 1 else "single"),
            on_engine_death=getattr(args, "on_engine_death", None) or "exit",
            trace=args.trace,
            trace_hops=args.trace_hops,
            **_flow_args(args),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    """Flags first, then the model's defaults (``ModelInfo.sampling_defaults``), then ours."""
    from actorllm.wire.messages import InvalidRequest, SamplingParams

    def pick(flag: Any, key: str, fallback: Any) -> Any:
        return flag if flag is not None else defaults.get(key, fallback)

    try:
        params = SamplingParams(
            n=args.n,
            # None lets the Tokenizer apply the model's max_new_tokens within the context.
            max_tokens=args.max_tokens if args.max_tokens is not None
            else (None if "max_tokens" in defaults else 64),
            temperature=float(pick(args.temperature, "temperature", 1.0)),
            top_p=float(pick(args.top_p, "top_p", 1.0)),
            top_k=int(pick(args.top_k, "top_k", 0)),
            min_p=float(pick(args.min_p, "min_p", 0.0)),
            repetition_penalty=float(pick(args.repetition_penalty, "repetition_penalty", 1.0)),
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        params.validate()
    except InvalidRequest as exc:
        raise CliError(f"--{(exc.param or '').replace('_', '-')}: {exc}") from None
    return params


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        try:
            text = args.prompts_file.read_text()
        except OSError as exc:
            raise CliError(f"cannot read --prompts-file: {exc.strerror}: {exc.filename}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CliError("give at least one PROMPT or --prompts-file")
    return prompts


def load_resources(config: Any) -> Any:
    """Tokenizer and weights; a bad directory or an unusable backend is a CliError."""
    from actorllm.engine.async_engine import Resources
    from actorllm.ops import BackendUnavailable

    try:
        return Resources(config)
    except (ValueError, BackendUnavailable) as exc:
        raise CliError(str(exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    config = engine_config(args)
    prompts = read_prompts(args)
    from actorllm.config import check_tensor_parallel_size, read_model_info

    try:
        info = read_model_info(config.model, config.max_model_len)
        check_tensor_parallel_size(config.model, config.tensor_parallel_size)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    params = sampling_params(args, info.sampling_defaults)
    resources = load_resources(config)
    stream = len(prompts) == 1 and params.n == 1 and args.output == "text"
    if stream:
        return trio.run(_stream_one, config, resources, prompts[0], params)
    return trio.run(_run_many, config, resources, prompts, params, args.output)


async def _stream_one(config: Any, resources: Any, prompt: str, params: Any) -> int:
    from actorllm.engine.async_engine import open_engine
    from actorllm.frontend.outputs import RequestError
    from actorllm.llm import make_request

    async with open_engine(config, resources=resources) as engine:
        try:
            async for out in engine.generate(make_request("cli-0", prompt, params)):
                for o in out.outputs:
                    sys.stdout.write(o.text)
                    sys.stdout.flush()
        except RequestError as exc:
            sys.stderr.write(f"actorllm: error: {exc}\n")
            return 1
    sys.stdout.write("\n")
    return 0


async def _run_many(config: Any, resources: Any, prompts: list[str], params: Any,
                    output: str) -> int:
    import trio
    from rich.progress import Progress

    from actorllm.engine.async_engine import open_engine
    from actorllm.llm import GenerationResult, collect

    results: list[GenerationResult | None] = [None] * len(prompts)
    with Progress(transient=True, console=_stderr_console()) as progress:
        task = progress.add_task("generating", total=len(prompts))
        async with open_engine(config, resources=resources) as engine:

            async def one(i: int) -> None:
                results[i] = await collect(engine, f"cli-{i}", prompts[i], params)
                progress.advance(task)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
    failed = 0
    for i, res in enumerate(results):
        assert res is not None
        if res.error is not None:
            failed += 1
            sys.stderr.write(f"actorllm: prompt {i}: error: {res.error}\n")
            if output == "jsonl":
                sys.stdout.write(json.dumps({"prompt": prompts[i], "error": res.error}) + "\n")
            continue
        for o in res.outputs:
            if output == "jsonl":
                sys.stdout.write(json.dumps({
                    "prompt": prompts[i], "index": o.index, "text": o.text,
                    "token_ids": list(o.token_ids), "finish_reason": o.finish_reason,
                    "usage": {"prompt_tokens": res.num_prompt_tokens,
                              "completion_tokens": len(o.token_ids)},
                }) + "\n")
            else:
                head = f"[{i}]" if len(res.outputs) == 1 else f"[{i}.{o.index}]"
                sys.stdout.write(f"{head} {prompts[i]!r} -> {o.text}\n")
    return 1 if failed else 0


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def cmd_serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    from actorllm.server import serve_main

    return serve_main(config, args)


def cmd_rank(args: argparse.Namespace) -> int:
    """``actorllm rank``: one tensor-parallel rank (actorllm/worker/ranks.py ``serve_rank``)."""
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise CliError("--cpu-threads must be at least 1")
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format=f"%(asctime)s %(levelname)s [rank {rank} %(process)d] "
                               "%(name)s: %(message)s")
    from actorllm.worker.rank_process import serve_rank

    try:  # leaves the process itself once it has joined (rank_process._leave)
        serve_rank(args.model, timeout=args.timeout, num_threads=args.cpu_threads,
                   watch_stdin=args.watch_stdin)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def cmd_replica(args: argparse.Namespace) -> int:
    """``actorllm replica``: one data-parallel replica (actorllm/topology/remote.py)."""
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise CliError("--cpu-threads must be at least 1")
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format=f"%(asctime)s %(levelname)s [replica {os.environ.get('RANK', '?')}"
                               " %(process)d] %(name)s: %(message)s")
    from actorllm.topology.remote import serve_replica

    try:
        code = serve_replica(args.model, timeout=args.timeout, num_threads=args.cpu_threads)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    # As a local replica does (actorllm/topology/__main__.py): skip the interpreter's
    # finalization, seconds of freeing torch's memory, and the store's heartbeat thread.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_replay(args: argparse.Namespace) -> int:
    from actorllm.replay import replay_main

    return replay_main(args)


def openmp_defaults(environ: dict[str, str] | os._Environ[str]) -> None:
    """OpenMP settings for a process that runs a Worker beside other busy threads; set
    before torch loads OpenMP, and only where the user has set neither.

    ``GOMP_SPINCOUNT=10000``: a torch thread waiting between parallel regions spins
    briefly (well under a millisecond), then sleeps. A step's regions come back to back,
    so the spin catches the next one; between steps the thread sleeps and leaves the
    core to the event loop (and, across processes, to the HTTP process). Spinning for
    libgomp's default (300,000) took cores others needed: on 2 cores beside another
    process busy half the time, a 64-sequence decode step took 200-600 ms. Never
    spinning (``OMP_WAIT_POLICY=PASSIVE``, the default before) wakes a sleeping thread
    for every region: the same step alone took 15-17 ms against 10-12 ms with the short
    spin, and was not slower beside a busy thread or process (``ops/threads.py``).
    """
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = "10000"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``actorllm`` console script."""
    args = build_parser().parse_args(argv)
    if (problem := flag_error(args)) is not None:  # before logging, and the model, load
        sys.stderr.write(f"actorllm: error: {problem}\n")
        return EXIT_USAGE
    openmp_defaults(os.environ)  # torch is not imported yet (its modules load lazily)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "rank":
            return cmd_rank(args)
        if args.command == "replica":
            return cmd_replica(args)
        return cmd_replay(args)
    except CliError as exc:
        sys.stderr.write(f"actorllm: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from actorllm.topology import EngineStartError

        if not isinstance(exc, EngineStartError):
            raise
        # A child process of --topology engine|pipeline could not start: its own reason.
        sys.stderr.write(f"actorllm: error: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
