"""Write the seed corpora (``fuzz/corpus/<name>/``): ``python fuzz/seeds.py``.

The seeds are committed; this script says where they came from and rebuilds them when a
message, a schema or the spec changes. Each is a valid, interesting input, so the fuzzer
starts from the shapes that matter instead of from nothing.
"""

from __future__ import annotations

import hashlib
import json

from _harness import corpus_dir

from actorllm.lifecycle.table import ACTORS, load_spec
from actorllm.wire import codec
from actorllm.wire.messages import (
    AbortRequest,
    ChatMessage,
    DetokSetup,
    FlowControl,
    GenerateRequest,
    NewSeqData,
    OutputBatch,
    PromptLogprobs,
    ReplicaLost,
    RequestFailed,
    RequestFinished,
    SamplingParams,
    ScheduledSeq,
    SchedulerStats,
    SequenceRequest,
    StepPlan,
    StepResult,
    StopMatched,
    TextDelta,
    TokenBatch,
    TokenLogprob,
    TokenOut,
)


def _write(name: str, seeds: list[bytes]) -> None:
    d = corpus_dir(name)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    for data in seeds:
        (d / hashlib.sha1(data).hexdigest()).write_bytes(data)


def codec_seeds() -> list[bytes]:
    p = SamplingParams(n=2, stop=("a", "\n"), logit_bias=((3, -1.5),), logprobs=2, seed=7)
    lp = TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0)))
    msgs = [
        p, ChatMessage("user", "hi"), AbortRequest("r"),
        # data parallelism: the replica a rid was routed to, on each message that needs it
        AbortRequest("r", 1), FlowControl("r", True, 1), ReplicaLost(1),
        GenerateRequest("r", p, prompt="hello", replica=1),
        GenerateRequest("r", p, messages=(ChatMessage("user", "héllo"),)),
        GenerateRequest("r", p, prompt="hello"),
        GenerateRequest("r", p, prompt_token_ids=(1, 2, 3)),
        SequenceRequest("r", (0, 5, 6), p, 16, (1,), 2.5),
        RequestFailed("r", "bad", "invalid_request", "max_tokens"),
        StepPlan.of_rows(3, (ScheduledSeq("r", (5, 6), 0, (0, 1), True,
                                          NewSeqData(p, (5, 6), (7,))),), ("old",)),
        StepResult(3, (9,), None, 0.01, 0.002, logprob_rows=(0,), logprobs=(lp,)),
        StepResult(4, error="boom"),
        TokenBatch.of((TokenOut("r", (9,), (lp,), "stop", "a", None, DetokSetup(("a",))),),
                   ("r",), SchedulerStats(1, 2, 3, 4)),
        TokenBatch.of((), ("r",), SchedulerStats(1, 2, 3, 4, replica=1)),
        StopMatched("r", "a"),
        OutputBatch.of((TextDelta("r", "x", (9,), (lp,)),),
                    (RequestFinished("r", "length", None, 3),), ("r",)),
        # prompt logprobs: asked for in the plan, reported by the Worker, passed on
        StepPlan.of_rows(5, (ScheduledSeq("r", (5, 6, 7), 0, (0,), False, None, 1),)),
        StepResult(5, prompt_logprobs=(PromptLogprobs("r", 1, (lp, lp)),)),
        TokenBatch.of((TokenOut("r", finish_reason="length", prompt_logprobs=(None, lp),
                             prompt_token_ids=(3, 5)),)),
        OutputBatch.of((TextDelta("r", "", (), (), (None, lp), (3, 5)),)),
    ]
    return [codec.encode(m) for m in msgs]


def request_seeds() -> list[bytes]:
    bodies = [
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text",
                                                                  "text": "hi"}]}],
         "max_completion_tokens": 8, "temperature": 0.7, "top_p": 0.9, "n": 2,
         "stop": ["\n", "END"], "stream": True, "stream_options": {"include_usage": True},
         "logprobs": True, "top_logprobs": 3, "seed": 1, "logit_bias": {"5": -100}},
        {"prompt": "Once upon a time", "max_tokens": 16},
        {"prompt": [1, 2, 3], "echo": True, "logprobs": 2},
        {"prompt": [[0, 5, 6], [0, 7]], "echo": True, "logprobs": 1, "max_tokens": 0,
         "temperature": 0, "seed": 1234},
        {"messages": [{"role": "user", "content": "Hello"}], "prompt_logprobs": 2},
        {"prompt": ["a", "b"], "n": 3, "stop": "x", "top_k": 40, "min_p": 0.05,
         "repetition_penalty": 1.1, "presence_penalty": -1.0, "frequency_penalty": 0.5},
        {"prompt": [[1, 2], [3]], "stop_token_ids": [2], "min_tokens": 1,
         "ignore_eos": True, "include_stop_str_in_output": True,
         "skip_special_tokens": False, "user": "u"},
        {"messages": [{"role": "user", "content": None}], "max_tokens": None,
         "temperature": None, "add_generation_prompt": False},
    ]
    return [json.dumps(b).encode() for b in bodies]


def lifecycle_seeds() -> list[bytes]:
    spec = load_spec()
    events = (*spec.events(), "", "bogus")

    def frame(path: list[str], rid: int = 0) -> bytes:
        out = bytearray()
        for event in path:
            actor = spec.actor_of(event)
            out += bytes(((rid << 5) | ACTORS.index(actor), events.index(event)))
        return bytes(out)

    happy = ["register", "dispatch", "enqueue", "schedule", "finish", "respond", "free",
             "forget"]
    return [
        frame(happy),
        frame(["register", "dispatch", "enqueue", "schedule", "preempt", "schedule",
               "abort", "free", "respond", "forget"]),
        frame(["register", "dispatch", "reject", "respond", "forget"]),
        frame(["register", "fan_out", "gather"], 1) + frame(happy, 2),
        frame(["register", "dispatch", "enqueue", "lose", "respond", "forget"], 3),
        bytes((0, 0x80)) + b"not-an-event\x00",
    ]


def detokenizer_seeds() -> list[bytes]:
    import tokenizers

    from actorllm.config import default_model_dir

    tok = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))

    def ids(text: str) -> bytes:
        return b"".join(t.to_bytes(2, "big") for t in tok.encode(text).ids)

    text = "Hello world, héllo → 世界 🙂 naïve café"
    stop = tok.encode("world").ids[:3]
    return [
        bytes((1, 0)) + ids(text),
        bytes((1, 2)) + ids(text),
        bytes((1 | 4, 0, len(stop))) + b"".join(t.to_bytes(2, "big") for t in stop)
        + ids(text),
        bytes((3 | 4, 1, len(stop))) + b"".join(t.to_bytes(2, "big") for t in stop)
        + ids(text),
        bytes((0, 3)) + ids("emoji 🙂🙃 and CJK 漢字") + b"\xff\x00\x01\x00\x00",
    ]


def main() -> None:
    _write("codec", codec_seeds())
    _write("request", request_seeds())
    _write("lifecycle", lifecycle_seeds())
    _write("detokenizer", detokenizer_seeds())
    for name in ("codec", "request", "lifecycle", "detokenizer"):
        print(name, len(list(corpus_dir(name).iterdir())))


if __name__ == "__main__":
    main()
