"""Fuzz the wire codec: arbitrary bytes into ``codec.decode``.

Contract (actorllm/wire/codec.py): a frame becomes the exact message that was sent, or raises
``CodecError``; nothing else escapes. And whatever decodes must encode again to a frame
that decodes to the same message (compared by encoding: a NaN float is not equal to
itself, but it encodes the same).

    python fuzz/fuzz_codec.py -atheris_runs=20000 fuzz/corpus/codec
"""

from __future__ import annotations

from _harness import main

from actorllm.wire import codec
from actorllm.wire.codec import CodecError

NAME = "codec"


def TestOneInput(data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except CodecError:
        return
    frame = codec.encode(msg)
    assert codec.encode(codec.decode(frame)) == frame, (msg, frame)


if __name__ == "__main__":
    main(TestOneInput)
