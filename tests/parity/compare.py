"""Token-exact comparison where the logits allow it, and the numbers the search reports at the end.

Greedy equality is required wherever the deciding logits are not a near-tie. Two computations of
the same logits differ by rounding (transformers and the engine sum in different orders; two engine
settings run different kernel shapes), so where the reference's top-1 and top-2 logits are closer
than ``Tolerance.margin`` either token is a correct answer, and the request is compared no further
(its later tokens follow a different context). Every token before that must be equal, its log prob
within ``Tolerance.log_prob``, and a request compared to its end must end the same way.

The thresholds, per dtype, from the largest errors measured on tokens both sides chose (default
search of 200 + 200 cases unless said otherwise):

- float32: |log prob difference| at most 3.3e-6 against transformers, 2.4e-6 between two engine
  settings (CPU). A margin of 1e-3 is 300 times that; no step of the default search fell under it.
- bfloat16: at most 0.084 against transformers and 0.068 between settings (CPU, 100 + 100 cases,
  where 21 of about 2,100 steps ended a comparison at a near-tie); 0.25 leaves room for a GPU's
  different kernels. float16 (not measured here) is given 0.1: three more mantissa bits than bf16.

For sampled requests (engine against itself) no margin can be read from the outputs, so a
divergence is accepted only where the two runs' reported top log probs at that step differ (the
sampler saw different logits); if they are identical, the draw depended on something else (the
batch, the setting), which is the bug this search looks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_serve import DynamicInferenceRequest, FinishReason, RequestStatus

from .reference import Reference

STOP = "<stop>"


@dataclass(frozen=True)
class Tolerance:
    margin: float  # top-1 minus top-2 logit below which either token is right
    log_prob: float  # largest |difference| of a log prob both sides computed


TOLERANCES = {
    torch.float32: Tolerance(margin=1e-3, log_prob=1e-3),
    torch.bfloat16: Tolerance(margin=0.25, log_prob=0.25),
    torch.float16: Tolerance(margin=0.1, log_prob=0.1),
}


@dataclass
class Tally:
    """What one search compared: the end-of-run summary, and the evidence that the search is not vacuous."""

    cases: int = 0
    requests: int = 0
    tokens: int = 0  # tokens compared equal
    near_ties: int = 0  # requests whose comparison ended at a near-tie (either token right)
    preempted: int = 0  # requests preempted at least once
    cached: int = 0  # requests that read prompt tokens from the prefix cache
    largest_log_prob_error: float = 0.0
    accepted_drafts: int = 0  # speculative guesses accepted in the rows that speculate (0: those rows ran nothing)
    adapter_rows: int = 0  # compared requests that ran under a LoRA adapter
    settings: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        settings = "".join(f", {name}: {count}" for name, count in sorted(self.settings.items()))
        return (f"{self.cases} cases, {self.requests} requests, {self.tokens} tokens equal, {self.near_ties} ended at "
                f"a near-tie, {self.preempted} preempted, {self.cached} prefix-cache hits, largest |log prob "
                f"error| {self.largest_log_prob_error:.1e}, {self.accepted_drafts} drafts accepted, {self.adapter_rows} "
                f"adapter requests{settings}")

    def merge(self, other: "Tally") -> None:
        """Adds another process's tally of the same search (pytest-xdist runs the cases over several workers)."""
        for name in ("cases", "requests", "tokens", "near_ties", "preempted", "cached", "accepted_drafts",
                     "adapter_rows"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.largest_log_prob_error = max(self.largest_log_prob_error, other.largest_log_prob_error)
        for name, count in other.settings.items():
            self.settings[name] = self.settings.get(name, 0) + count

    def observe(self, request: DynamicInferenceRequest) -> None:
        self.requests += 1
        self.preempted += any(e.type.value == "PREEMPT" for e in request.events)
        self.cached += request.cached_tokens > 0
        self.adapter_rows += request.sampling_params.lora_name is not None


TALLIES: dict[str, Tally] = {}


def _choices(request: DynamicInferenceRequest) -> list[int | str]:
    stopped = request.finish_reason is FinishReason.STOP
    return list(request.generated_tokens) + ([STOP] if stopped else [])


def _log_probs_close(name: str, what: str, got: list[float], expected: list[float], tolerance: Tolerance,
                     tally: Tally) -> str | None:
    if len(got) != len(expected):
        return f"{name}: {len(got)} {what} where {len(expected)} were expected"
    if not got:
        return None
    error = float(np.max(np.abs(np.array(got) - np.array(expected))))
    tally.largest_log_prob_error = max(tally.largest_log_prob_error, error)
    if error > tolerance.log_prob:
        return f"{name}: {what} differ by up to {error:.2e} (tolerance {tolerance.log_prob})"
    return None


def _first_difference(got: list[int | str], expected: list[int | str]) -> int | None:
    for index in range(max(len(got), len(expected))):
        if index >= len(got) or index >= len(expected) or got[index] != expected[index]:
            return index
    return None


def against_reference(name: str, request: DynamicInferenceRequest, reference: Reference, tolerance: Tolerance,
                      tally: Tally) -> str | None:
    """The engine's request against transformers'; a problem in one line, or None."""
    tally.observe(request)
    if request.status is not RequestStatus.COMPLETED:
        return f"{name} did not complete: {request.status.value} {request.error}"
    if request.prompt_tokens != reference.prompt:
        return f"{name}: the engine's prompt {request.prompt_tokens} is not transformers' {reference.prompt}"
    problem = _log_probs_close(name, "prompt log probs", request.prompt_log_probs, reference.prompt_log_probs,
                               tolerance, tally)
    got = _choices(request)
    expected: list[int | str] = reference.choices + ([STOP] if reference.stopped else [])
    index = _first_difference(got, expected)
    equal = len(reference.choices) if index is None else min(index, len(reference.choices))
    tally.tokens += equal
    problem = problem or _log_probs_close(name, "log probs", request.generated_log_probs[:equal],
                                          reference.log_probs[:equal], tolerance, tally)
    if problem or index is None:
        return problem
    if index < len(expected) and reference.margins[index] < tolerance.margin:
        tally.near_ties += 1
        return None
    have = got[index] if index < len(got) else f"<end: {request.finish_reason.value}>"
    want = expected[index] if index < len(expected) else "<end>"
    margin = f"margin {reference.margins[index]:.2e}" if index < len(expected) else "transformers ended"
    return (f"{name} step {index}: the engine chose {have}, transformers {want} ({margin}; "
            f"tokens before: {reference.choices[:index]})")


def _margin(top: dict[int, float]) -> float:
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def between_runs(name: str, a: DynamicInferenceRequest, b: DynamicInferenceRequest, tolerance: Tolerance,
                 tally: Tally) -> str | None:
    """The same request under setup A and setup B; a problem in one line, or None."""
    tally.observe(b)
    for run, request in (("A", a), ("B", b)):
        if request.status is not RequestStatus.COMPLETED:
            return f"{name} did not complete under {run}: {request.status.value} {request.error}"
    problem = _log_probs_close(name, "prompt log probs (B vs A)", b.prompt_log_probs, a.prompt_log_probs, tolerance,
                               tally)
    got_a, got_b = _choices(a), _choices(b)
    index = _first_difference(got_b, got_a)
    equal = min(len(a.generated_tokens), len(b.generated_tokens)) if index is None else index
    equal = min(equal, len(a.generated_tokens), len(b.generated_tokens))
    tally.tokens += equal
    problem = problem or _log_probs_close(name, "log probs (B vs A)", b.generated_log_probs[:equal],
                                          a.generated_log_probs[:equal], tolerance, tally)
    if problem:
        return problem
    if index is None:
        if a.routing_indices is not None and not np.array_equal(a.routing_indices, b.routing_indices):
            return f"{name}: the same tokens were routed to different experts under A and B"
        return None
    tops = [r.generated_top_n_logprobs[index] for r in (a, b) if index < len(r.generated_top_n_logprobs)]
    params = a.sampling_params
    if params.is_greedy and not params.has_logits_controls:
        accepted = bool(tops) and min(_margin(top) for top in tops) < tolerance.margin
    else:  # sampled or controlled: only where the sampler saw different logits (or one side stopped)
        accepted = not (len(tops) == 2 and tops[0] == tops[1])
    if accepted:
        tally.near_ties += 1
        return None
    have_a = got_a[index] if index < len(got_a) else "<end>"
    have_b = got_b[index] if index < len(got_b) else "<end>"
    return f"{name} step {index}: A chose {have_a}, B chose {have_b} (top log probs A, B: {tops})"
