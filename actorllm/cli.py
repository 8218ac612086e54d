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
from typing import Any

from actorllm.cli_checks import flag_error
from actorllm.cli_flags import build_parser
from actorllm.exit_codes import EXIT_USAGE, say_error

# `actorllm run`'s length when neither --max-tokens nor the model's max_new_tokens is set.
CLI_MAX_TOKENS = 64


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _flow_args(args: argparse.Namespace) -> dict[str, Any]:
    """The slow-client flags EngineConfig takes (``actorllm serve`` only; 0 means None)."""
    names = ("max_pending_bytes_per_request", "max_pending_bytes", "stream_timeout")
    return {n: getattr(args, n) or None for n in names if hasattr(args, n)}


def engine_config(args: argparse.Namespace) -> Any:
    from actorllm.config import EngineConfig, default_model_dir
    from actorllm.hub import resolve_model

    try:
        return EngineConfig(
            model=resolve_model(args.model or str(default_model_dir()), args.revision),
            model_impl=args.model_impl,
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
            cuda_graphs=args.cuda_graphs,
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
            speculative_config=args.speculative_config,
            **_flow_args(args),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    """Flags first, then the model's defaults (``ModelInfo.sampling_defaults``), then ours;
    64 tokens when neither the flags nor the model name a length."""
    from actorllm.wire.sampling import InvalidRequest, resolve_sampling

    given = {"n": args.n, "max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty, "seed": args.seed,
             "stop": tuple(args.stop), "ignore_eos": args.ignore_eos}
    try:
        params = resolve_sampling(given, defaults, max_tokens=CLI_MAX_TOKENS)
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
    from actorllm.llm import make_request
    from actorllm.wire.outputs import RequestError

    async with open_engine(config, resources=resources) as engine:
        try:
            async for out in engine.generate(make_request("cli-0", prompt, params)):
                for o in out.outputs:
                    sys.stdout.write(o.text)
                    sys.stdout.flush()
        except RequestError as exc:
            say_error(exc)
            return 1
    sys.stdout.write("\n")
    return 0


async def _run_many(config: Any, resources: Any, prompts: list[str], params: Any,
                    output: str) -> int:
    import trio

    from actorllm.engine.async_engine import open_engine
    from actorllm.llm import GenerationResult, collect, progress_bar

    results: list[GenerationResult | None] = [None] * len(prompts)
    with progress_bar(len(prompts)) as advance:
        async with open_engine(config, resources=resources) as engine:

            async def one(i: int) -> None:
                results[i] = res = await collect(engine, f"cli-{i}", prompts[i], params)
                advance(res)

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
    from actorllm.worker.rank_process import leave, serve_rank

    try:  # a rank leaves the process itself (rank_process.leave), never by returning
        serve_rank(args.model, timeout=args.timeout, num_threads=args.cpu_threads,
                   watch_stdin=args.watch_stdin)
    except ValueError as exc:
        # Once joined, the heartbeat's thread is inside the store's C++ client, and the
        # interpreter's own exit aborted now and then (SIGABRT, -6, in place of 2).
        say_error(exc)
        leave(EXIT_USAGE)


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``actorllm`` console script."""
    args = build_parser().parse_args(argv)
    if (problem := flag_error(args)) is not None:  # before logging, and the model, load
        say_error(problem)
        return EXIT_USAGE
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
        say_error(exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from actorllm.topology import EngineStartError

        if not isinstance(exc, EngineStartError):
            raise
        # A child process of --topology engine|pipeline could not start: its own reason.
        say_error(exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
