"""What tensor parallelism's communication costs per step on this machine (docs/architecture.md).

Starts ``--world`` processes in a gloo group on loopback (NCCL with ``--device cuda``)
and times, for several batch sizes, the collectives of one step of a model with
``--hidden`` and ``--layers``: the driver's two broadcasts of the batch and two
all-reduces of ``[tokens, hidden]`` per layer. Prints one JSON line per size.

    python benchmarks/allreduce.py                 # the embedded model: 256 x 6 layers
    python benchmarks/allreduce.py --hidden 4096 --layers 32   # a 7B Llama's shapes
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, args: argparse.Namespace) -> None:
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.world)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=device, dtype=getattr(torch, args.dtype))
        header = torch.zeros(6, dtype=torch.int64, device=device)
        payload = torch.zeros(4 * tokens + 64, dtype=torch.int64, device=device)
        for _ in range(3):  # warm up the connections
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            dist.broadcast(header, 0)
            dist.broadcast(payload, 0)
            for _ in range(2 * args.layers):
                dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step = (time.perf_counter() - t0) / args.steps
        if rank == 0:
            print(json.dumps({
                "world": args.world, "tokens": tokens, "hidden": args.hidden,
                "layers": args.layers, "dtype": args.dtype,
                "bytes_per_allreduce": tokens * args.hidden * x.element_size(),
                "allreduce_us": round(step / (2 * args.layers + 2) * 1e6, 1),
                "comm_ms_per_step": round(step * 1e3, 3),
            }), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        _run(args.rank, args)
        return 0
    import subprocess

    args.port = _port()
    others = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r),
                                "--port", str(args.port)], env=dict(os.environ))
              for r in range(1, args.world)]
    _run(0, args)
    return max([o.wait() for o in others], default=0)


if __name__ == "__main__":
    sys.exit(main())
