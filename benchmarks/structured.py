"""The cost of structured output: constrained, unconstrained and mixed batches.

    python benchmarks/structured.py [--model DIR] [--prompts 32] [--max-tokens 64]
                                    [--rounds 3] [--serial-masks]

Three arms through ``LLM.generate`` on one set of weights, alternating round by round:
every prompt unconstrained (``free``), every prompt under a JSON schema (``json``), and
half and half (``mixed``). Every row makes exactly ``--max-tokens`` tokens
(``ignore_eos``, and a schema that cannot complete in that budget: an array of at least
1000 short strings), so the arms do the same model work and differ only in the grammar
masks. Reported per arm: the median over rounds of output tokens/s, and the ratio of
each arm's to ``free``'s (1.0: no overhead). Target (issue 16): ``mixed`` within a few
percent of ``free``: the rows without a grammar must not pay for their neighbours'.
The Worker computes the masks in a thread while the forward pass runs; ``--serial-masks``
adds ``json-serial`` and ``mixed-serial``, the same arms with the masks computed after
the forward (``MaskFiller.overlap = False``), to show what the overlap buys.
Results go to ``benchmarks/results/structured.json`` and ``.md``. Without --model, the
embedded default model is used.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1000}


def run_arm(llm: Any, prompts: list[str], params: list[Any]) -> float:
    """Output tokens per second of one ``generate`` call."""
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    return tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serial-masks", action="store_true",
                    help="also the json and mixed arms with masks computed after the forward")
    ap.add_argument("--no-save", action="store_true", help="print only (for smoke runs)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from actorllm.llm import LLM
    from actorllm.wire.messages import SamplingParams, StructuredOutput

    llm = LLM(args.model)
    prompts = [f"Item {i} of the list:" for i in range(args.prompts)]
    free = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8,
                          seed=1)
    constrained = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                 temperature=0.8, seed=1,
                                 structured=StructuredOutput("json", json.dumps(SCHEMA)))
    arms = {
        "free": [free] * len(prompts),
        "json": [constrained] * len(prompts),
        "mixed": [constrained if i % 2 else free for i in range(len(prompts))],
    }
    if args.serial_masks:
        arms["json-serial"], arms["mixed-serial"] = arms["json"], arms["mixed"]
    masks = llm.resources.runner.masks  # the Worker's MaskFiller (single topology)
    run_arm(llm, prompts[:4], arms["mixed"][:4])  # warm-up: weights, grammar compile
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, params in arms.items():
            masks.overlap = not name.endswith("-serial")
            rates[name].append(run_arm(llm, prompts, params))
    masks.overlap = True
    med = {name: statistics.median(r) for name, r in rates.items()}
    report = {
        "machine": platform.platform(), "prompts": args.prompts,
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "tokens_per_s": med, "ratio_to_free": {k: v / med["free"] for k, v in med.items()},
    }
    lines = ["| arm | tokens/s | ratio to free |", "|---|---|---|"]
    lines += [f"| {k} | {med[k]:.1f} | {med[k] / med['free']:.3f} |" for k in arms]
    print("\n".join(lines))
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "structured.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / "structured.md").write_text(
            f"# Structured output overhead\n\n{report['machine']}, {args.prompts} prompts x "
            f"{args.max_tokens} tokens, median of {args.rounds} rounds.\n\n"
            + "\n".join(lines) + "\n")
    print(f"ratio: {med['mixed'] / med['free']:.3f}")


if __name__ == "__main__":
    main()
