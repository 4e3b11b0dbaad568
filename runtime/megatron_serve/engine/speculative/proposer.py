"""The one interface every speculative method implements: given a request's tokens, guess the next ones.

The engine owns verification, the KV cache and the output; a proposer owns only its guesses and
whatever state it keeps per request (a draft model's own cache, an n-gram index). It is called on
the step thread once per step with the rows that may speculate, and told when a request leaves or
the weights change, so a stale drafter never proposes under a new epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class DraftInput:
    """What a proposer sees of one request: its id and every token it has (prompt + generated)."""

    request_id: str
    token_ids: Sequence[int]
    num_tokens: int  # how many tokens to propose at most this step (0: none)


class Proposer(Protocol):
    """Guesses up to ``num_tokens`` next tokens per request; may return fewer, or none."""

    #: whether :meth:`observe` reads the target's hidden states (else the engine does not call it: a plain
    #: step of 64 rows built its list of rows for nothing)
    reads_hidden_states: bool

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        """One list of guessed token ids per input, in order; each at most ``input.num_tokens`` long."""
        ...

    def forget(self, request_id: str) -> None:
        """The request left the engine (finished, aborted, preempted out): drop its state."""
        ...

    def observe(self, rows: Sequence[tuple[str, int, int]]) -> None:
        """A target forward ran rows ``(request id, first position, count)``, in row order (the MTP layer
        reads the target's hidden states of those rows; other methods ignore it)."""
        ...

    def on_refit(self, epoch: int) -> None:
        """The target's weights changed to ``epoch``: drop or refit anything computed under the old ones."""
        ...
