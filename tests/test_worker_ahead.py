"""The Worker's side of rows planned ahead (worker/ahead.py): it starts them after the
rid's last sample and drafts for them by the n-gram lookup over the tokens the Scheduler
sent and the ones its previous step emitted; what does not fit is an error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.text.ngram import lookup_ngram
from actorllm.wire.messages import FEED_LAST_SAMPLE, AheadRows, StepPlan
from actorllm.worker.ahead import AheadLookup

PROMPT = (5, 6, 7, 5, 6)


def _cols(prompt_len: int, num_out: int, last: int, slots: int = 2) -> dict[str, np.ndarray]:
    """The sampling batch's columns the lookup reads, with slot 0 holding the rid."""
    cols = {"occupied": np.zeros(slots, dtype=bool), "num_out": np.zeros(slots, dtype=np.int64),
            "prompt_len": np.zeros(slots, dtype=np.int64),
            "last_token": np.zeros(slots, dtype=np.int64)}
    cols["occupied"][:] = True
    cols["num_out"][0], cols["prompt_len"][0], cols["last_token"][0] = num_out, prompt_len, last
    cols["num_out"][1], cols["prompt_len"][1], cols["last_token"][1] = 1, 3, 42
    return cols


def _lookup() -> AheadLookup:
    """A lookup whose previous step emitted 7 and then 5 for ``a`` (it verified one draft
    of three and then corrected)."""
    look = AheadLookup()
    look.ran(StepPlan(6, ("a",), (4,), (6, 7, 8, 9), (4,), (True,), (0,)), {0: [7, 5]})
    return look


def _plan(caps: tuple[int, ...], start: int, hist_from: int = 0,
          hist: tuple[int, ...] = PROMPT, drafts: int = 3) -> StepPlan:
    """Row 0: ``a`` planned ahead (FEED and ``drafts`` placeholders from ``start``); row 1:
    ``b``, a plain decode row."""
    return StepPlan(7, ("a", "b"), (1 + drafts, 1), (FEED_LAST_SAMPLE, *[0] * drafts, 9),
                    (start, 3), (True, True), (0, 0), num_drafts=(drafts, 0),
                    ahead=AheadRows((0,), caps, (hist_from,), (len(hist),), hist, 1, 3))


def test_a_row_starts_after_its_last_sample_with_the_lookups_drafts() -> None:
    """The previous step accepted one draft of three (7, then 5): the row starts at 6,
    not at the planned 8, and drafts what the lookup over all seven tokens gives, cut to
    the caps of the match length found."""
    look = _lookup()
    plan, drafted, kinds = look.resolve(_plan((1, 2, 3), 8), {"a": 0, "b": 1},
                                        _cols(5, 2, 5), frozenset())
    tokens = [*PROMPT, 7, 5]
    want, n = lookup_ngram(tokens, 3, 1, 3)
    assert n == 3 and want == [6, 7, 5]
    assert plan.token_ids == (5, *want, 9) and plan.num_tokens == (4, 1)
    assert plan.start_pos == (6, 3) and plan.num_drafts == (3, 0) and plan.ahead is None
    assert (drafted, kinds) == ((3,), (3,))
    # Shorter caps for that kind: fewer drafts, the row shrinks.
    plan, drafted, _ = _lookup().resolve(_plan((3, 3, 1), 8), {"a": 0, "b": 1},
                                         _cols(5, 2, 5), frozenset())
    assert plan.token_ids == (5, 6, 9) and plan.num_drafts == (1, 0) and drafted == (1,)


def test_what_does_not_fit_the_rids_state_is_an_error() -> None:
    ok = ({"a": 0, "b": 1}, _cols(5, 2, 5), frozenset[str]())
    with pytest.raises(ValueError, match="sent from position 2, 0 held"):
        _lookup().resolve(_plan((1, 2, 3), 8, hist_from=2), *ok)
    with pytest.raises(ValueError, match="past the row's planned start 5"):
        _lookup().resolve(_plan((1, 2, 3), 5), *ok)
    with pytest.raises(ValueError, match="5 tokens held and 1 emitted"):
        AheadLookup().resolve(_plan((1, 2, 3), 8), *ok)  # (no run of the previous step)
    with pytest.raises(ValueError, match="nothing was sampled"):
        _lookup().resolve(_plan((1, 2, 3), 8), {"b": 1}, *ok[1:])
    with pytest.raises(ValueError, match="holds"):
        _lookup().resolve(_plan((1, 2, 9), 8), *ok)  # caps past its placeholders


def test_a_row_after_a_failed_step_runs_a_stand_in_and_one_without_caps_only_starts() -> None:
    plan, drafted, kinds = AheadLookup().resolve(_plan((1, 2, 3), 8), {"a": 0, "b": 1},
                                                 _cols(5, 1, 7), frozenset({"a"}))
    assert plan.token_ids == (0, 9) and plan.start_pos == (8, 3) and not plan.num_drafts
    assert (drafted, kinds) == ((0,), (0,))
    plan, drafted, _ = _lookup().resolve(_plan((0, 0, 0), 8, hist=()), {"a": 0, "b": 1},
                                         _cols(5, 2, 5), frozenset())
    assert plan.token_ids == (5, 9) and plan.start_pos == (6, 3) and drafted == (0,)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=40), st.integers(1, 4),
       st.integers(1, 3))
def test_the_kept_index_finds_what_a_scan_of_the_whole_list_finds(
        tokens: list[int], recent: int, k: int) -> None:
    """Held tokens sent in two pieces, then the last ``recent`` ones as the previous
    step's: the same drafts and match length as the lookup over the whole list."""
    recent = min(recent, len(tokens) - 1)
    held, tail = tokens[:-recent], tokens[-recent:]
    look = AheadLookup()
    look.extend("a", 0, held[:len(held) // 2])
    look.extend("a", len(held) // 2, held[len(held) // 2:])
    assert look.lookup("a", tail, k, 1, 3) == lookup_ngram(tokens, k, 1, 3)
