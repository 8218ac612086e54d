"""The ``actorllm`` command's flags: one parser, no heavy imports (``--help`` is instant)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="model directory or hub id (default: the embedded model)")
    g.add_argument("--revision", default=None, help="a hub id's branch, tag or commit")
    g.add_argument("--model-impl", choices=["auto", "native", "transformers"], default="auto",
                   help="auto: the native model where it exists, else transformers'")
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
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="replay decode steps from CUDA graphs captured at start-up, one per "
                        "bucket of batch sizes up to --max-num-seqs (native models, one GPU)")
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
                        "forward in the Worker (default: on for CUDA; on the CPU with one "
                        "rank, on in single and engine; off otherwise; in engine on the "
                        "CPU no step is planned ahead within 0.1 s of an arrival)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 1}\' (n-gram prompt lookup), or '
                        '\'{"method": "draft_model", "model": DIR, '
                        '"num_speculative_tokens": 3}\' (a smaller draft model)')
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
    serve.add_argument("--tool-call-parser",
                       choices=["json", "hermes", "llama3_json", "mistral", "pythonic"],
                       default="json",
                       help="how the model writes tool calls (server/tool_parsers.py)")
    serve.add_argument("--on-engine-death", choices=["exit", "stay"], default="exit",
                       help="when the engine dies: fail in-flight requests, then exit with "
                       "code 3 (exit, for a supervisor to restart) or keep answering 503; "
                       "with --data-parallel-size, stay fails only a dead replica's requests "
                       "and serves on with the others")
    _feature_flags(serve)
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


def _feature_flags(p: argparse.ArgumentParser) -> None:
    """Reasoning models, the chat template, the Responses API's store, embeddings
    (``server/features.py`` checks the values)."""
    p.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                   help="split <think>...</think> reasoning into reasoning_content")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a Jinja chat template file to use instead of the model's")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="responses kept for previous_response_id (oldest dropped first)")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored response is kept")
    p.add_argument("--pooling", choices=["last", "mean", "cls"], default=None,
                   help="/v1/embeddings: the last token's, the mean or the first token's "
                        "final hidden state (default: the model's sentence-transformers "
                        "config, else last)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's config and chat "
                   "template; lm-evaluation-harness tokenizes through the server with it)")


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
    g.add_argument("--max-stream-hold", type=float, default=0.1, metavar="S",
                   help="while the engine waits for the server's loop and writing streams is "
                   "a large share of that loop's time, hold a stream's next write up to "
                   "this long so that one write carries the tokens of several steps "
                   "(server/pacing.py); 0: write every step")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="408 when a request body has not fully arrived after this long")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="close an idle connection (or unfinished headers) after this long")
