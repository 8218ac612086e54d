"""Every message round-trips through the codec; any bytes decode to a message or CodecError."""

from __future__ import annotations

import typing

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.wire import codec, messages
from actorllm.wire.messages import MESSAGE_TYPES

_ints = st.integers(min_value=-(2**62), max_value=2**62)
_floats = st.floats(allow_nan=False, width=64)


def strategy_for(hint: typing.Any) -> st.SearchStrategy[typing.Any]:
    """A hypothesis strategy for any annotation the messages use."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return _ints
    if hint is float:
        return _floats
    if hint is str:
        return st.text(max_size=20)
    if attrs.has(hint):
        return message_strategy(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of(*(strategy_for(a) for a in typing.get_args(hint)))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    raise TypeError(hint)


def message_strategy(cls: type) -> st.SearchStrategy[typing.Any]:
    hints = typing.get_type_hints(cls, vars(messages))
    fields = {f.name: st.deferred(lambda h=hints[f.name]: strategy_for(h))
              for f in attrs.fields(cls)}
    return st.builds(cls, **fields)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_message_type_round_trips(cls: type) -> None:
    @settings(max_examples=examples(60), deadline=None)
    @given(message_strategy(cls))
    def check(msg: typing.Any) -> None:
        back = codec.decode(codec.encode(msg))
        assert type(back) is cls
        assert back == msg

    check()


@settings(max_examples=examples(400), deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_to_a_message_or_codec_error(data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except codec.CodecError:
        return
    assert type(msg) in MESSAGE_TYPES


@settings(max_examples=examples(300), deadline=None)
@given(st.recursive(st.none() | st.booleans() | _ints | _floats | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4), max_leaves=20),
       st.sampled_from([c.__name__ for c in MESSAGE_TYPES]))
def test_structured_garbage_is_rejected_with_codec_error(fields: typing.Any, name: str) -> None:
    # Well-formed msgpack with a real type name but arbitrary fields: the hard case.
    data = msgpack.packb([codec.VERSION, [name, fields]])
    try:
        msg = codec.decode(data)
    except codec.CodecError:
        return
    assert type(msg).__name__ == name
    # What the decoder let through is a message of exactly its declared field types, all
    # the way down (checked here against the annotations, not by the codec's own code).
    assert _conforms(msg, type(msg)), msg
    assert codec.decode(codec.encode(msg)) == msg


def _conforms(value: typing.Any, hint: typing.Any) -> bool:
    """Whether ``value`` is exactly of the annotated type (``bool`` is not an ``int``)."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return value is None
    if hint in (bool, int, str, float):
        return type(value) is hint
    if attrs.has(hint):
        if type(value) is not hint:
            return False
        hints = typing.get_type_hints(hint, vars(messages))
        return all(_conforms(getattr(value, f.name), hints[f.name])
                   for f in attrs.fields(hint))
    if origin in (typing.Union, __import__("types").UnionType):
        return any(_conforms(value, a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if type(value) is not tuple:
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_conforms, value, args))
    raise TypeError(hint)


def _wrong_value(hint: typing.Any) -> typing.Any:
    """A value of a type ``hint`` does not allow: None, or a map (no field is a map)."""
    return {"a": 1} if _conforms(None, hint) else None


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_a_field_of_the_wrong_type_is_a_codec_error(cls: type) -> None:
    # Each field in turn, in an otherwise valid message, gets a value of a type its
    # annotation does not allow: the frame is refused, naming no crash but CodecError.
    @settings(max_examples=examples(10), deadline=None)
    @given(message_strategy(cls), st.data())
    def check(msg: typing.Any, data: st.DataObject) -> None:
        wire = msgpack.unpackb(codec.encode(msg), strict_map_key=False)
        hints = typing.get_type_hints(cls, vars(messages))
        names = [f.name for f in attrs.fields(cls)]
        i = data.draw(st.integers(0, len(names) - 1), label="field")
        fields = list(wire[1][1])
        fields[i] = _wrong_value(hints[names[i]])
        with pytest.raises(codec.CodecError):
            codec.decode(msgpack.packb([wire[0], [wire[1][0], fields]]))

    check()


def test_wrong_field_type_is_rejected() -> None:
    data = msgpack.packb([codec.VERSION, ["AbortRequest", [42, 0]]])
    with pytest.raises(codec.CodecError, match="expected str"):
        codec.decode(data)


def test_unknown_type_and_version_are_rejected() -> None:
    with pytest.raises(codec.CodecError, match="unknown message type"):
        codec.decode(msgpack.packb([codec.VERSION, ["Pickle", []]]))
    with pytest.raises(codec.CodecError, match="version"):
        codec.decode(msgpack.packb([99, ["AbortRequest", ["a"]]]))


def test_unregistered_objects_cannot_be_encoded() -> None:
    with pytest.raises(codec.CodecError):
        codec.encode(object())


def test_unhashable_garbage_in_a_union_field_is_rejected() -> None:
    # TokenOut.stop_reason is `str | int | None`; a list there must not crash the decoder.
    fields = ["r", [], [], None, [[1], 2], None, None, None, None, [], [], []]
    assert len(fields) == len(attrs.fields(messages.TokenOut))  # fails on the union, not arity
    with pytest.raises(codec.CodecError, match="matches no type"):
        codec.decode(msgpack.packb([codec.VERSION, ["TokenOut", fields]]))


# --- the columnar step messages: whole plans and results, consistent across columns ---

_rows = st.lists(st.builds(
    messages.ScheduledSeq,
    rid=st.text(max_size=6),
    token_ids=st.lists(st.integers(-1, 2**31), min_size=1, max_size=5).map(tuple),
    start_pos=st.integers(0, 2**20),
    new_blocks=st.lists(st.integers(0, 2**20), max_size=4).map(tuple),
    sample=st.booleans(),
    new=st.none() | message_strategy(messages.NewSeqData),
    prompt_logprobs_from=st.none() | st.integers(1, 2**20),
), max_size=6)


@settings(max_examples=examples(150), deadline=None)
@given(_rows, st.lists(st.text(max_size=4), max_size=3).map(tuple), st.data())
def test_a_columnar_plan_and_its_result_round_trip(rows: list[typing.Any],
                                                   drop: tuple[str, ...],
                                                   data: st.DataObject) -> None:
    plan = messages.StepPlan.of_rows(7, rows, drop)
    back = codec.decode(codec.encode(plan))
    assert back == plan and back.seqs == tuple(rows) and back.drop == drop
    # Sparse per-request data stay sparse: one entry per row that has it.
    assert len(plan.new) == sum(r.new is not None for r in rows)
    assert len(plan.lp_rows) == sum(r.prompt_logprobs_from is not None for r in rows)
    n = sum(r.sample for r in rows)
    tokens = data.draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n))
    asked = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    lp_rows = tuple(j for j in range(n) if asked[j])
    lps = tuple(messages.TokenLogprob(tokens[j], -1.0 * j) for j in lp_rows)
    result = messages.StepResult(7, tuple(tokens), logprob_rows=lp_rows, logprobs=lps)
    again = codec.decode(codec.encode(result))
    assert again == result
    sampled = again.sampled(plan)
    assert [t.rid for t in sampled] == [r.rid for r in rows if r.sample]
    assert [t.token_id for t in sampled] == tokens
    assert [t.logprob is not None for t in sampled] == asked


# --- the columnar output messages: a step's rows, plain ones without an object ---------

_token_outs = st.lists(st.one_of(
    st.builds(messages.TokenOut, rid=st.sampled_from(["a", "b", "c"]),
              token_ids=st.lists(st.integers(0, 2**31), max_size=3).map(tuple)),
    message_strategy(messages.TokenOut),
), max_size=8)
_text_deltas = st.lists(st.one_of(
    st.builds(messages.TextDelta, rid=st.sampled_from(["a", "b"]), text=st.text(max_size=5),
              token_ids=st.lists(st.integers(0, 2**31), max_size=3).map(tuple)),
    message_strategy(messages.TextDelta),
), max_size=8)


@settings(max_examples=examples(150), deadline=None)
@given(_token_outs, st.lists(st.text(max_size=3), max_size=2).map(tuple))
def test_a_columnar_token_batch_round_trips(rows: list[messages.TokenOut],
                                            freed: tuple[str, ...]) -> None:
    batch = messages.TokenBatch.of(rows, freed, messages.SchedulerStats(steps=3))
    back = codec.decode(codec.encode(batch))
    assert back == batch and back.outputs == tuple(rows) and back.freed == freed
    # Only the rows with more than tokens get an object, and it holds no tokens.
    plain = [r == messages.TokenOut(r.rid, r.token_ids) for r in rows]
    assert len(batch.rare) == plain.count(False)
    assert all(r.token_ids == () for r in batch.rare)
    assert batch.token_ids == tuple(t for r in rows for t in r.token_ids)


@settings(max_examples=examples(150), deadline=None)
@given(_text_deltas, st.lists(message_strategy(messages.RequestFinished), max_size=2))
def test_a_columnar_output_batch_round_trips(deltas: list[messages.TextDelta],
                                             finished: list[messages.RequestFinished]) -> None:
    batch = messages.OutputBatch.of(deltas, tuple(finished), ("x",))
    back = codec.decode(codec.encode(batch))
    assert back == batch and back.deltas == tuple(deltas)
    assert back.finished == tuple(finished) and back.freed == ("x",)
    plain = [d == messages.TextDelta(d.rid, d.text, d.token_ids) for d in deltas]
    assert len(batch.rare) == plain.count(False)
    assert all(d.text == "" and d.token_ids == () for d in batch.rare)
