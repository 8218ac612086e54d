"""A step's text deltas as the Detokenizer builds them: the columns of an ``OutputBatch``.

A plain row (a rid's text and tokens) appends to four lists and builds no object; a row
with logprobs or prompt logprobs also keeps them as a ``TextDelta`` without its text.
"""

from __future__ import annotations

import attrs

from actorllm.wire.messages import OutputBatch, RequestFinished, SchedulerStats, TextDelta


class DeltaColumns:
    """The growing delta columns of one OutputBatch (see ``OutputBatch``)."""

    __slots__ = ("num_tokens", "rare", "rare_rows", "rids", "texts", "token_ids")

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.texts: list[str] = []
        self.num_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.rare_rows: list[int] = []
        self.rare: list[TextDelta] = []

    def __bool__(self) -> bool:
        return bool(self.rids)

    def plain(self, rid: str, text: str, token: int) -> None:
        """A row of one token and nothing rare (the hot path)."""
        self.rids.append(rid)
        self.texts.append(text)
        self.num_tokens.append(1)
        self.token_ids.append(token)

    def append(self, d: TextDelta) -> None:
        """Any row, as an object."""
        if d.logprobs or d.prompt_logprobs or d.prompt_token_ids:
            self.rare_rows.append(len(self.rids))
            self.rare.append(attrs.evolve(d, text="", token_ids=()))
        self.rids.append(d.rid)
        self.texts.append(d.text)
        self.num_tokens.append(len(d.token_ids))
        self.token_ids.extend(d.token_ids)

    def batch(self, finished: tuple[RequestFinished, ...], freed: tuple[str, ...],
              stats: SchedulerStats | None) -> OutputBatch:
        """The OutputBatch of these deltas."""
        return OutputBatch(tuple(self.rids), tuple(self.texts), tuple(self.num_tokens),
                           tuple(self.token_ids), tuple(self.rare_rows), tuple(self.rare),
                           finished, freed, stats)
