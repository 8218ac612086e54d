"""Slow-reader scenario (issue 13): what slow streaming clients do to everyone else.

    python benchmarks/slow_readers.py --url http://127.0.0.1:8000 --model NAME
    python benchmarks/slow_readers.py --spawn --smoke     # starts actorllm serve itself

Two phases against one OpenAI-compatible server (actorllm or vLLM, any topology):
``--clients`` well-behaved streaming clients alone, then the same with ``--slow-fraction``
more clients that read one SSE event per ``1 / --slow-rate`` seconds (with a small
receive buffer, so the server's writes back up). Reported: the well-behaved clients' p50
and p99 inter-token latency (gap between SSE events carrying tokens) and TTFT in each
phase, and the ratio with/without slow readers. Each client sends ``--requests`` requests
in a row. Results go to stdout as JSON (and ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


async def one_request(host: str, port: int, model: str, prompt: str, max_tokens: int,
                      slow_gap: float | None, api_key: str | None) -> dict[str, Any]:
    """One streamed completion; the arrival time of each token-carrying event."""
    if slow_gap is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    else:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    start = time.monotonic()
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{auth}"
                  "Content-Type: application/json\r\nConnection: close\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    await writer.drain()
    times: list[float] = []
    error = None
    try:
        await reader.readuntil(b"\r\n\r\n")
        while True:
            line = await reader.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                if line.startswith(b"data: [DONE]"):
                    break
                if b'"error"' in line[:20]:
                    error = line.decode(errors="replace")[:200]
                    break
                times.append(time.monotonic())
                if slow_gap is not None:
                    await asyncio.sleep(slow_gap)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        error = repr(exc)
    finally:
        writer.close()
    return {"start": start, "times": times, "error": error}


async def client(args: argparse.Namespace, host: str, port: int, i: int, slow: bool,
                 out: list[dict[str, Any]]) -> None:
    for r in range(args.requests):
        res = await one_request(host, port, args.model, f"client {i} request {r}: tell me",
                                args.max_tokens, 1.0 / args.slow_rate if slow else None,
                                args.api_key)
        res["slow"] = slow
        out.append(res)


async def phase(args: argparse.Namespace, host: str, port: int, n_slow: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    async with asyncio.timeout(args.timeout):
        await asyncio.gather(*(client(args, host, port, i, False, results)
                               for i in range(args.clients)),
                             *(client(args, host, port, args.clients + i, True, results)
                               for i in range(n_slow)),
                             return_exceptions=False)
    fast = [r for r in results if not r["slow"]]
    itl = [b - a for r in fast for a, b in zip(r["times"], r["times"][1:], strict=False)]
    ttft = [r["times"][0] - r["start"] for r in fast if r["times"]]
    return {"slow_clients": n_slow, "requests": len(fast),
            "errors": sum(1 for r in results if r["error"]),
            "slow_errors": [r["error"] for r in results if r["slow"] and r["error"]][:3],
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_mean_s": statistics.fmean(itl) if itl else None}


def spawn(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "actorllm", "serve", "--port", "0",
           "--served-model-name", args.model, *args.server_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving" in line and "http://" in line:
            return proc, line.split(" at ")[-1].strip()
    raise RuntimeError("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=18, help="well-behaved streaming clients")
    p.add_argument("--slow-fraction", type=float, default=0.1,
                   help="slow clients added, as a fraction of all clients")
    p.add_argument("--slow-rate", type=float, default=1.0, help="events/s a slow client reads")
    p.add_argument("--requests", type=int, default=4, help="requests per client, in a row")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--spawn", action="store_true", help="start `actorllm serve` here")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="with --spawn: flags for actorllm serve (last on the line)")
    p.add_argument("--smoke", action="store_true", help="a tiny run that checks the script")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.clients, args.requests, args.max_tokens = 3, 1, 16
    proc = None
    if args.spawn:
        proc, args.url = spawn(args)
    try:
        host, port = args.url.removeprefix("http://").rsplit(":", 1)
        n_slow = max(1, round(args.slow_fraction * args.clients / (1 - args.slow_fraction)))
        without = asyncio.run(phase(args, host, int(port), 0))
        with_slow = asyncio.run(phase(args, host, int(port), n_slow))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    ratio = (with_slow["itl_p99_s"] / without["itl_p99_s"]
             if with_slow["itl_p99_s"] and without["itl_p99_s"] else None)
    result = {"url": args.url, "clients": args.clients, "slow_rate": args.slow_rate,
              "max_tokens": args.max_tokens, "without_slow": without,
              "with_slow": with_slow, "itl_p99_ratio": ratio, "smoke": args.smoke}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
