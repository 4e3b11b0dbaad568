"""What a step is, between the engine's calls: a launched step whose results are still on the device
(:class:`InFlightStep`, what ``finish`` reads; a verify step's draws too, :class:`Verification`), one request's rows
of it as read (:class:`Emitted`) and what a step did for one request (:class:`StepOutput`, what ``step()`` hands
out: one per request, as an engine process sends a step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import torch

from ..wire.deltas import PromptScores
from ..wire.request import FinalRecord
from .sampling.sampler import DeviceSample, DeviceScores, Readback
from .sequence import Sequence

#: The record a caller added a request as, when it was not the engine's own request (Megatron's expert API's public
#: request, :mod:`.expert_api`): handed back with each output, never read here.
Record = TypeVar("Record")


@dataclass
class Emitted:
    """What one request's rows of a step produced: the tokens to append, in order, and how many of its drafts were
    accepted (a plain step's row: one token, none; drafts are data, :mod:`.drafts`)."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    top_ids: list[list[int] | None] = field(default_factory=list)  # each token's top-n, as the wire carries them
    top_log_probs: list[list[float] | None] = field(default_factory=list)
    accepted: int = 0  # drafts accepted (the tokens less the bonus one)
    kept_ids: list[list[int] | None] = field(default_factory=list)  # return_top_p_token_ids, per token (or none)


@dataclass(slots=True)
class StepOutput(Generic[Record]):
    """What one step did for one request, with every fact its delta carries (:func:`.output.step_delta` copies them):
    the tokens it added and what was asked to go with them, and whether it is done. Generic in the caller's record it
    carries back (``request``), which the adapter that added it sets and types (:mod:`.expert_api`)."""

    request_id: str
    new_tokens: list[int]
    new_log_probs: list[float]
    finished: bool
    epochs: tuple[int, int, int] = (-1, -1, -1)  # the new tokens' weights, KV and adapter generations (one step's)
    # top-n log probs of each new token, as the wire carries them: ``top_ids[i]`` and ``top_log_probs[i]``
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    top_p_token_ids: list[list[int]] | None = None  # return_top_p_token_ids: the ids kept at each new token
    new_routing: tuple[int, np.ndarray] | None = None  # (first position, routing rows) since the last output
    # With the request's first tokens (or its end, when it ends before any): what its admission found
    cached_tokens: int | None = None
    prompt_scores: PromptScores | None = None
    final: FinalRecord | None = None  # once finished: the record without what the deltas carried
    stop_token: bool = False  # the last new token is the stop id that ended it (kept in the ids, not in the text)
    request: Record | None = None  # the caller's record of the request, for one added as such (.expert_api)

    def extend(self, later: StepOutput[Record]) -> None:
        """Append what a later output of the same request added (one output per request and step is what the
        engine's readers get: an engine process sends a step as one delta per request)."""
        if not self.new_tokens:
            self.epochs = later.epochs
        self.new_tokens += later.new_tokens
        self.new_log_probs += later.new_log_probs
        if later.top_ids is not None and later.top_log_probs is not None:
            self.top_ids = (self.top_ids or []) + later.top_ids
            self.top_log_probs = (self.top_log_probs or []) + later.top_log_probs
        if later.top_p_token_ids is not None:
            self.top_p_token_ids = (self.top_p_token_ids or []) + later.top_p_token_ids
        self.finished = later.finished
        self.final = later.final
        self.stop_token = later.stop_token
        if later.new_routing is not None:  # the positions of later tokens: they continue the rows before
            self.new_routing = (later.new_routing if self.new_routing is None else
                                (self.new_routing[0], np.concatenate([self.new_routing[1], later.new_routing[1]])))


@dataclass
class Verification:
    """A verify step's draws launched on the device, not read yet (the speculator's ``launch_verify``): what the
    plan of the step after it reads (``shifts``) before the host reads the draws."""

    sample: DeviceSample  # every depth's drawn token, request by request, depth by depth
    drafts: list[list[int]]  # each sampling request's drafts
    shifts: torch.Tensor  # [requests] int64, on the device: drafts rejected (the next step's correction)


@dataclass
class InFlightStep:
    """A launched step whose results are still on the device: what ``finish`` needs to read them."""

    entries: list[tuple[Sequence, int]]
    starts: list[int]  # each entry's first position (its num_computed before the step)
    sampling: list[Sequence]  # in the order of the sampled rows
    kv_epochs: list[int]  # each sampled row's KV generation at launch (a preemption meanwhile clears the sequence's)
    logits: torch.Tensor | None  # the sampling rows' logits until they are sampled
    scores: tuple[list[tuple[Sequence, range]], DeviceScores] | None  # prompt positions scored, and their scores
    routing: Readback | None  # expert ids of the step's tokens, when some entry records them
    positions: list[int]  # each sampled row's position (as planned: before the device's correction)
    generated: list[int]  # each sampled row's request's tokens generated before it (as planned, likewise)
    shift: torch.Tensor | None = None  # each logits row's correction by the verify step before (plan.shifted)
    sample: DeviceSample | None = None  # None until sampled (a grammar row waits for the step before)
    verify_logits: torch.Tensor | None = None  # draft rows' logits of a speculative step (engine.speculative)
    drafts: list[int] | None = None  # a verify step's drafts per sampling row
    verification: Verification | None = None  # an overlapped verify step's draws and accepted counts, on the device
    emitted: list[Emitted] | None = None  # a verify step read at once (a fallback): its tokens per sampling row


def one_per_request(outputs: list[StepOutput]) -> list[StepOutput]:
    """``outputs`` with each request's later ones folded into its first: a verify step that reads the step in
    flight first has a request's tokens of both, and an engine process sends a step as one delta per request
    (two for one request lost the first's tokens: a fleet's request ended 5 tokens short)."""
    first: dict[str, StepOutput] = {}
    merged = []
    for out in outputs:
        earlier = first.get(out.request_id)
        if earlier is None:
            first[out.request_id] = out
            merged.append(out)
        else:
            earlier.extend(out)
    return merged
