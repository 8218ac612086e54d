"""Builders for the tiny tokenizer and models the test suite shares, and a transformers oracle.

Everything here runs offline in a second or two: the tokenizer is a byte-level BPE
trained on ``CORPUS`` on the spot, the models are random-weight Llama / Qwen2
checkpoints written with ``save_pretrained``. ``tests/conftest.py`` wraps the builders
in session-scoped fixtures; import them directly when a test needs a variant.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import trio

if TYPE_CHECKING:
    from actorllm.engine.async_engine import AsyncEngine

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1  # special tokens are added first, in SPECIAL_TOKENS order

# Qwen2's split (digits one by one, ...). transformers 5 rebuilds the pipeline of a Qwen2
# directory's tokenizer with exactly this regex + NFC whatever tokenizer.json says, so the
# shared tokenizer uses it everywhere: then every fixture directory tokenizes alike.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = """\
The river runs past the old mill and under the stone bridge before it reaches the sea.
In the morning the fishermen walk down to the harbour, check their nets and talk about
the weather. Some days the wind comes from the west and the boats stay in; other days
the water is calm and bright, and the whole town seems to move a little slower.
A small library stands on the corner of the market square. Its shelves hold books about
history, science, cooking, gardening and the stars. Children come after school to read
stories about dragons, ships and faraway islands, and the librarian knows every one of them
by name. She says that a good question is worth more than a quick answer.
The baker opens at six. He makes bread with flour, water, salt and time, and he likes to
say that time is the ingredient most people forget. By seven there is a line outside the
door: teachers, nurses, students and the man who repairs clocks on Baker Street.
Hello! How are you today? I am fine, thank you. What would you like to know?
Can you explain how a computer works? A computer follows instructions. It reads numbers
from memory, adds them, compares them and writes the results back. Programs are long lists
of such instructions, written by people who want the machine to solve a problem for them.
What is the capital of France? The capital of France is Paris. What is two plus two?
Two plus two is four. Please write a short poem about the moon. The moon is round and pale,
it walks across the night, it hums a quiet tale and fills the sea with light.
Language models predict the next word from the words that came before. They are trained
on large amounts of text, and they learn patterns of grammar, facts and style. When you
ask a question, the model writes an answer one token at a time, and each token depends on
everything that was written earlier in the conversation.
The garden behind the house has apple trees, a row of beans, tomatoes, onions and a bench
in the shade. In summer the bees are busy from dawn to dusk. In autumn the leaves turn red
and gold, and the apples fall into the long grass where the children find them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024. Punctuation: , . ; : ! ? ( ) " ' - /
The train leaves the station at nine and arrives in the city before noon. Passengers read
newspapers, drink coffee and look out of the window at fields, farms, forests and hills.
Thank you for your help. You are welcome. Goodbye, and have a nice day!
"""


def build_tokenizer(save_dir: str | Path, vocab_size: int = 400) -> Any:
    """Train a byte-level BPE on ``CORPUS`` and save it as a ``PreTrainedTokenizerFast``.

    Special tokens get ids 0..5 (``<|bos|>`` = 0, ``<|eos|>`` = 1). Pre-tokenization is
    Qwen2's (see ``PRETOKENIZE_REGEX``). Plain ``encode``
    prepends ``<|bos|>``; the chat template writes it itself (``apply_chat_template``
    tokenizes without special tokens), like Llama 3.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        # Without an unk token, a Qwen2 directory's tokenizer adds "<|endoftext|>" as one,
        # past the model's vocabulary. BPE on bytes never needs it.
        unk_token=EOS,
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )
    fast.save_pretrained(str(save_dir))
    return fast


def build_tiny_model(
    save_dir: str | Path,
    family: str = "llama",
    tokenizer_dir: str | Path | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint (config, safetensors, generation config, tokenizer).

    ``family`` is ``"llama"`` (GQA 4/2 heads, untied embeddings), ``"qwen2"`` (qkv bias,
    tied embeddings) or ``"mistral"`` (like llama, with a sliding window in its config).
    ``init_std`` is larger than the HF default so that greedy outputs vary from token to
    token instead of collapsing onto one id. ``overrides`` go into the config (e.g.
    ``rope_parameters``, ``num_hidden_layers``).
    """
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(save_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(save_dir))
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        config = LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
        from transformers import LlamaForCausalLM as Model
    elif family == "mistral":
        config = MistralConfig(**{**common, "tie_word_embeddings": False, **overrides})
        from transformers import MistralForCausalLM as Model
    elif family == "qwen2":
        common.pop("head_dim")  # Qwen2 derives it: hidden_size // num_attention_heads = 16
        config = Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        from transformers import Qwen2ForCausalLM as Model
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = Model(config).eval()
    with torch.no_grad():
        # HF zero-inits biases; random ones make the Qwen2 qkv-bias path actually matter.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, init_std)
    model.save_pretrained(str(save_dir), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID).save_pretrained(
        str(save_dir)
    )
    return save_dir


def hf_model(model_dir: str | Path, attn_implementation: str | None = None) -> Any:
    """The checkpoint loaded by transformers in fp32 eval mode (the oracle); attention as
    transformers picks it unless ``attn_implementation`` says."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()


def hf_greedy(
    model_dir: str | Path | Any, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy ``generate`` for one prompt: the new ids and each one's logprob (raw logits).

    Generation runs to ``max_new_tokens`` whatever the ids (eos does not stop it), so tests
    can compare a fixed number of tokens. ``model_dir`` may also be a loaded HF model.
    """
    model = hf_model(model_dir) if isinstance(model_dir, str | Path) else model_dir
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=EOS_ID,
        )
    new_ids = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [
        torch.log_softmax(step_logits[0].float(), dim=-1)[tid].item()
        for step_logits, tid in zip(out.logits, new_ids, strict=True)
    ]
    return new_ids, logprobs


def greedy_expectations(model_dir: str | Path, tokenizer: Any, prompts: list[str],
                        max_new_tokens: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """transformers' greedy continuation of each prompt, as ids and as text."""
    model = hf_model(model_dir)
    backend = tokenizer.backend_tokenizer
    out = {}
    for prompt in prompts:
        new, _ = hf_greedy(model, tokenizer(prompt).input_ids, max_new_tokens)
        out[prompt] = (tuple(new), backend.decode(new, skip_special_tokens=True))
    return out


async def collect_all(engine: AsyncEngine, prompts: list[Any],
                      params: Any) -> list[Any]:
    """Every prompt submitted at once (rids ``g0``, ``g1``, ...); results in prompt order."""
    from actorllm.llm import collect

    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await collect(engine, f"g{i}", prompts[i], params)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


# --- raw ASGI calls (the in-process server tests) -----------------------------------------

CONTEXT = 256  # the tiny models' max_position_embeddings


async def abort_three_of_four(engine: AsyncEngine, prompts: list[list[int]],
                               params: Any) -> list[str | None]:
    """Four requests; the first three aborted after 2, 5 and 8 tokens have come out
    (mid-stream, so with speculation their drafts may be in flight). Each request's last
    finish reason, in order."""
    from actorllm.wire.messages import GenerateRequest

    cols = [await engine.submit(GenerateRequest(f"r{i}", params, prompt_token_ids=tuple(p)))
            for i, p in enumerate(prompts[:4])]
    for i, col in enumerate(cols[:3]):
        got = 0
        while got < 2 + 3 * i:
            out = await col.get()
            got += sum(len(o.token_ids) for o in out.outputs)
        await engine.abort(f"r{i}")
    return [[o async for o in col][-1].outputs[-1].finish_reason for col in cols]


def sse_events(body: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent-event body, in order (``[DONE]`` included)."""
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]


class Call:
    """One ASGI request: the body is sent at once; ``disconnect`` makes the client leave."""

    def __init__(self, path: str, body: Any = None, method: str = "POST",
                 headers: dict[str, str] | None = None) -> None:
        self.scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())],
            "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000), "state": {},
        }
        self.body = b"" if body is None else json.dumps(body).encode()
        self.sent_body = False
        self.gone = trio.Event()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.done = False

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.append(message["body"])
            self.done = not message.get("more_body", False)

    async def run(self, app: Any) -> Call:
        await app(self.scope, self.receive, self.send)
        return self

    def json(self) -> Any:
        return json.loads(b"".join(self.chunks))

    def events(self) -> list[Any]:
        return sse_events(b"".join(self.chunks))


def app_for(engine: AsyncEngine, **kw: Any) -> Any:
    """The ASGI app over ``engine``, serving the model as ``m``."""
    from actorllm.server import build_app  # the server stack only for the tests that ask

    return build_app(engine, served_model_name="m", **kw)


# --- other hosts, played on loopback (tests/test_tp_hosts.py, tests/test_dp_hosts.py) ----


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by init, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs; returns those still running at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """``proc``'s exit code, or None if it still runs after ``timeout`` seconds."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def other_host(command: str, port: int, log: Path, model: Path, *, rank: int = 1,
               world: int = 2, timeout: float = 60.0) -> subprocess.Popen[bytes]:
    """``python -m actorllm COMMAND`` (``rank`` or ``replica``) started the way the
    README tells a second host to start it: the rendezvous in its environment, not a
    child the driver started; its output goes to ``log``."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with log.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "actorllm", command, "--model", str(model),
             "--cpu-threads", "1", "--timeout", str(timeout), "--log-level", "INFO"],
            env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)


def stream_chat(plan: Any, pieces: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    """Render ``pieces`` of one chat choice with the tool ``plan`` as SSE chunks, and the
    message the openai SDK's own stream state rebuilds from them: (message, chunks)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from actorllm.server.render import ChatRenderer
    from actorllm.wire.outputs import CompletionOutput

    renderer = ChatRenderer(response_id="chatcmpl-x", created=0, model="m", num_choices=1,
                            texts=None, logprobs=False, tools=plan)  # type: ignore[arg-type]

    class Job:
        index_base = 0
        echo = ""
        echo_skips_special = True

    state = ChatCompletionStreamState()
    chunks = renderer.prelude([])
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = CompletionOutput(0, piece, (1,), finish_reason="stop" if last else None)
        chunk = renderer.add(Job(), out)  # type: ignore[arg-type]
        if chunk is not None:
            chunks.append(chunk)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion(), chunks


@contextmanager
def vector_body(level: int) -> Iterator[None]:
    """The decode op's vector body capped at ``level`` (2 AVX-512, 1 AVX2, 0 the plain
    loops; ``torch.ops.actorllm.cap_vector_isa``, the op's library loaded) for a block, and
    back to the widest after; the test is skipped on a CPU that lacks that body."""
    try:
        if torch.ops.actorllm.cap_vector_isa(level) != level:
            pytest.skip("this CPU has no such vector unit")
        yield
    finally:
        torch.ops.actorllm.cap_vector_isa(2)
