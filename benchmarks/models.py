"""Offline tok/s of each model family, native against transformers-backed, and against
transformers' own ``generate`` (issue 30; docs/architecture.md, "Bring your own model").

Every family is built at one small shape (random weights, the tests' tiny tokenizer, no
download) and runs the same batch of prompts greedily for ``--max-tokens`` tokens:

* ``native``: ``LLM(model_impl="native")`` where the native model has the family;
* ``transformers``: ``LLM(model_impl="transformers")``, its modules with paged attention;
* ``hf-generate``: transformers' ``generate`` on the same batch, left-padded, sdpa (eager
  for Gemma 2, whose soft-cap sdpa lacks).

Prints one JSON line per (family, path) with output tok/s, and whether the path's tokens
equal the first path's. Needs a quiet machine: it is CPU-bound.

    python benchmarks/models.py                       # every family, 16 prompts
    python benchmarks/models.py --families llama qwen3 --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

FAMILIES = ["llama", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2", "mixtral",
            "qwen3_moe"]
NATIVE = {"llama", "qwen3", "mistral"}


def build(root: Path, family: str, args: argparse.Namespace) -> Path:
    """A random-weight checkpoint of ``family`` at the benchmark's shape."""
    import test_models_families as fam
    from helpers import build_tokenizer

    tok_dir = root / "tokenizer"
    if not tok_dir.is_dir():
        build_tokenizer(tok_dir)
    heads = max(2, args.hidden // 64)
    fam._COMMON.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=64,
                       max_position_embeddings=4096, initializer_range=0.05)
    return fam.build_family(root / family, family, tok_dir)


def prompts(model_dir: Path, n: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = "the farmer walks to the market in the morning and buys bread for the children"
    ids = tok(" ".join([words] * (length // 8 + 1))).input_ids
    return [ids[i % 7: i % 7 + length] for i in range(n)]


def run_engine(model_dir: Path, impl: str, batch: list[list[int]],
               args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    from actorllm.llm import LLM
    from actorllm.wire.messages import SamplingParams

    llm = LLM(str(model_dir), model_impl=impl, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    results = llm.generate(batch, params)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(r.outputs[0].token_ids) for r in results]


def run_generate(model_dir: Path, family: str, batch: list[list[int]],
                 args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    attn = "eager" if family == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    width = max(len(p) for p in batch)
    ids = torch.tensor([[1] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=1,
                             max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens)
    elapsed = time.perf_counter() - t0
    return elapsed, out[:, width:].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            model_dir = build(Path(tmp), family, args)
            batch = prompts(model_dir, args.prompts, args.prompt_len)
            paths = (["native"] if family in NATIVE else []) + ["transformers", "hf-generate"]
            first: list[list[int]] | None = None
            for name in paths:
                elapsed, tokens = run_generate(model_dir, family, batch, args) \
                    if name == "hf-generate" else run_engine(model_dir, name, batch, args)
                first = tokens if first is None else first
                print(json.dumps({
                    "family": family, "path": name, "hidden": args.hidden,
                    "layers": args.layers, "prompts": args.prompts,
                    "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                    "seconds": round(elapsed, 3),
                    "output_tok_s": round(args.prompts * args.max_tokens / elapsed, 1),
                    "same_tokens_as_first": tokens == first,
                }), flush=True)


if __name__ == "__main__":
    main()
