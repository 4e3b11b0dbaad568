"""Proof at run time that reported log probs are what scoring the same tokens gives (``--verify-logprobs-fraction``).

An RL trainer recomputes the log prob of every sampled token with a teacher-forced forward of prompt
+ completion; any gap between that and what the engine reported is off-policy noise. This module
checks the engine against itself in production: a fraction of the finished requests that reported
log probs is scored again, as a prompt (prompt + completion, the ``prompt_logprobs`` path: one
forward with every position at once, never read from the prefix cache), and the log prob each
generated token gets there is compared with the one reported while generating, with ``==`` on the
floats. Bitwise equality is what the batch-invariant mode promises; without it the two differ in
the last bits (float32 on CPU: a few of 24 tokens by about 5e-7), and this check says so.

Where it runs: the engine queues the scoring request when the original finishes, after the
original's output was handed out, so it adds nothing to that request's latency; it waits behind
every user request (lowest priority), is never handed to the caller, and its tokens and latencies
stay out of the engine's request metrics (it does take a step's compute, like a prompt of that length,
and the prefix-cache query counter sees its tokens). Which requests are checked is a function of the
request id alone (a hash), so a test or an incident replays the same choice; it is made when the request is
admitted, and only a chosen request's outputs are kept (its tokens, their log probs and epochs: the engine keeps
no such list of any other request). A refit while checks are queued voids them: the weights they would be scored
with are not those that generated the tokens.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, TypeVar

from ...wire.engine_stats import EngineStats
from ...wire.deltas import PromptScores
from ...wire.request import EngineRequest, FinalRecord, RequestStatus
from ...wire.sampling_fields import FILTERS, PRIORITY_MAX, SUBSET_FILTERS
from ...wire.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover - the checker itself handles no tensor
    from torch import Tensor

    from ..sequence import Sequence as EngineSequence

    Process = Callable[[Tensor, SamplingParams], Tensor]

logger = logging.getLogger(__name__)

#: Prefix of the engine's own scoring requests: no request id that crosses a process boundary holds a NUL.
SCORING_PREFIX = "\x00verify-logprobs:"


class EngineOutput(Protocol):
    """What :meth:`ParityChecker.sort` reads of an engine ``StepOutput``."""

    request_id: str
    new_tokens: list[int]
    new_log_probs: list[float]
    epochs: tuple[int, int, int]
    prompt_scores: PromptScores | None
    finished: bool
    final: FinalRecord | None


Output = TypeVar("Output", bound=EngineOutput)


class Verdict(enum.Enum):
    """How one check ended: log probs equal, some differ, or no verdict (the scoring failed or was voided)."""

    MATCH = "match"
    MISMATCH = "mismatch"
    VOID = "void"


def renormalized(params: SamplingParams) -> bool:
    """Whether a request's log probs are reported processed whatever the engine's mode: it asked for its kept ids
    (``return_top_p_token_ids``), samples, and sets a subset filter, so they are renormalized over the ids kept."""
    return (params.return_top_p_token_ids and not params.is_greedy
            and any(getattr(params, row.name) != row.default for row in SUBSET_FILTERS))


def chosen(request_id: str, fraction: float) -> bool:
    """Whether ``request_id`` is among the ``fraction`` checked: a 64-bit hash of the id below ``fraction * 2**64``
    (Python's own ``hash`` is salted per process, so it would choose differently in every engine)."""
    if fraction <= 0.0:
        return False
    digest = int.from_bytes(hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
    return digest < fraction * 2**64


@dataclass
class PendingCheck:
    """What a queued check compares with: the log probs reported for the generated tokens it covers."""

    request_id: str
    reported: list[float]
    first: int  # index in the scoring request's prompt log probs of the first generated token
    void: bool = False
    scored: list[float] | None = None  # the scoring request's prompt log probs, once its output carried them


@dataclass
class Reported:
    """What the outputs of a request chosen for a check reported, kept until it finishes (its tokens, their log
    probs, and every weights and KV generation they came from)."""

    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    epochs: set[int] = field(default_factory=set)

    def add(self, out: EngineOutput) -> None:
        if out.new_tokens:
            self.tokens += out.new_tokens
            self.log_probs += out.new_log_probs
            self.epochs.update(out.epochs[:2])


class ParityChecker:
    """The checks of one engine: which finished requests to score again, and the verdict once scored.

    ``max_sequence_length``: the engine's; a scoring prompt holds at most one token less (the engine
    admits a prompt only with room for one generated token), so a request that filled the context is
    checked on all its tokens but the last.
    """

    def __init__(self, fraction: float, max_sequence_length: int, logprobs_mode: str = "raw_logprobs",
                 process: Process | None = None) -> None:
        self.fraction = fraction
        self.max_sequence_length = max_sequence_length
        self.logprobs_mode = logprobs_mode
        self.process = process
        self.pending: dict[str, PendingCheck] = {}
        self.reported: dict[str, Reported] = {}  # the requests chosen for a check, until they finish

    @property
    def processed(self) -> bool:
        """Whether reported log probs are processed ones (``processed_logprobs``): a check then scores its rows
        through the same processing (:attr:`score_view`), with the original's filters (the table's ``FILTER`` rows,
        ``wire/sampling_fields.py``: temperature, top-k, top-p, min-p)."""
        return self.logprobs_mode == "processed_logprobs"

    @property
    def score_view(self) -> "Callable[[EngineSequence, Tensor], Tensor] | None":
        """For the prompt scorer: what to score a request's rows of logits as (a check's processed as its
        original's were), or None where every row is scored as it is."""
        if not self.active or self.process is None or not (self.processed or self.pending):
            return None
        return self._view

    def _view(self, sequence: EngineSequence, logits: "Tensor") -> "Tensor":
        # a check scores raw log probs greedily (temperature 0), processed ones with its original's filters
        params = sequence.sampling_params
        return self.process(logits, params) if self.owns(sequence.request_id) and not params.is_greedy else logits

    def _processes(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` reports processed log probs (the engine's mode, or its kept ids)."""
        return self.processed or renormalized(params)

    def comparable(self, params: SamplingParams) -> bool:
        """Whether scoring a prompt can give what was reported for a request with ``params``: log probs (the
        ``*_logits`` modes report logits), and in the processed mode no processing that reads the request's
        history (penalties, logit bias, min_tokens, a grammar), which a prompt's rows do not carry."""
        if not self.logprobs_mode.endswith("logprobs"):
            return False
        return not self._processes(params) or not (params.has_logits_controls or params.structured_outputs is not None)

    @property
    def active(self) -> bool:
        return self.fraction > 0.0

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of this checker's scoring requests (never handed to a caller)."""
        return request_id.startswith(SCORING_PREFIX)

    def admitted(self, sequence: EngineSequence) -> None:
        """A request was admitted: when it is chosen and could be checked (log probs, no images, nothing generated
        elsewhere), what its outputs report is kept until it finishes."""
        if (self.active and not self.owns(sequence.request_id) and chosen(sequence.request_id, self.fraction)
                and self.comparable(sequence.sampling_params) and not sequence.images and not sequence.num_output):
            self.reported[sequence.request_id] = Reported(sequence.prompt_tokens, sequence.sampling_params)

    def scoring_request(self, reported: Reported, final: FinalRecord, epoch: int) -> EngineRequest | None:
        """The request that scores a request (its outputs ``reported``, just finished in this engine with ``final``,
        under weights ``epoch``) again, or None when it is not checked: not completed, no log probs reported, or
        tokens generated under other weights than the current."""
        generated = reported.tokens
        if (final.status is not RequestStatus.COMPLETED or not generated
                or len(reported.log_probs) != len(generated) or not reported.epochs <= {epoch}):
            return None
        tokens = (reported.prompt + generated)[: self.max_sequence_length - 1]
        covered = len(tokens) - len(reported.prompt)
        if covered < 1:
            return None
        scoring_id = SCORING_PREFIX + final.request_id
        if scoring_id in self.pending:  # the same id finished again before its check ran: check the latest
            self.pending[scoring_id].void = True
            return None
        self.pending[scoring_id] = PendingCheck(final.request_id, reported.log_probs[:covered],
                                                len(reported.prompt) - 1)
        original = reported.params
        # processed: the original's processing, read back by score_view (its one drawn token from its own stream)
        processing = ({**{row.name: getattr(original, row.name) for row in FILTERS}, "seed": 0}
                      if self._processes(original) else {"temperature": 0.0})
        params = SamplingParams(num_tokens_to_generate=1, ignore_eos=True, return_prompt_log_probs=True,
                                priority=PRIORITY_MAX, cache_salt=original.cache_salt,  # the tenant's cache
                                **processing)
        return EngineRequest(request_id=scoring_id, prompt_tokens=tokens, sampling_params=params,
                             arrival_time=time.time())

    def void_all(self) -> None:
        """The weights changed (a refit): the checks queued compare with tokens of the old weights."""
        for check in self.pending.values():
            check.void = True

    def abandon(self, request_id: str) -> bool:
        """Forget a request that leaves without finishing (aborted, or handed back while draining: another engine
        cannot check this one's log probs). True for a scoring request of this checker, False for any other."""
        self.reported.pop(request_id, None)
        if not self.owns(request_id):
            return False
        self.pending.pop(request_id, None)
        return True

    def deliver(self, outputs: list[Output], epoch: int, stats: EngineStats,
                add: Callable[[EngineRequest], None]) -> list[Output]:
        """The engine's outputs for its caller, less those of its own checks; the checks of requests that finished
        are queued (``add``) here, after those requests' outputs were made."""
        if not self.active:
            return outputs
        delivered, scoring = self.sort(outputs, epoch, stats)
        for request in scoring:
            add(request)
        return delivered

    def sort(self, outputs: Sequence[Output], epoch: int, stats: EngineStats
             ) -> tuple[list[Output], list[EngineRequest]]:
        """``(the outputs for the caller, the scoring requests to queue)`` of one batch of engine outputs: the
        scoring requests' own outputs are kept back, and once finished judged and counted in ``stats``."""
        delivered, scoring = [], []
        for out in outputs:
            if self.owns(out.request_id):
                check = self.pending.get(out.request_id)
                if check is not None and out.prompt_scores is not None:
                    check.scored = out.prompt_scores.log_probs
                if out.final is not None and (verdict := self.settle(out.final)) is not Verdict.VOID:
                    stats.parity_checked(verdict is Verdict.MISMATCH)
                continue
            delivered.append(out)
            reported = self.reported.get(out.request_id)
            if reported is None:
                continue
            reported.add(out)
            if out.final is not None:
                del self.reported[out.request_id]
                if (request := self.scoring_request(reported, out.final, epoch)) is not None:
                    scoring.append(request)
        return delivered, scoring

    def settle(self, scoring: FinalRecord) -> Verdict:
        """The verdict of a finished scoring request; a mismatch is logged as a WARNING naming the request and
        the first generated token whose log probs differ."""
        check = self.pending.pop(scoring.request_id, None)
        if check is None or check.void or scoring.status is not RequestStatus.COMPLETED:
            if check is not None and scoring.status is RequestStatus.FAILED:
                logger.info("log-prob check of request %s not made: scoring failed (%s)", check.request_id,
                            scoring.error)
            return Verdict.VOID
        scored = (check.scored or [])[check.first : check.first + len(check.reported)]
        differ = next((i for i, (a, b) in enumerate(zip(check.reported, scored)) if a != b), None)
        if differ is None:
            return Verdict.MATCH
        logger.warning("log-prob parity mismatch: request %s, generated token %d (position %d of prompt + "
                       "completion): reported %r while generating, %r when scored (%d of %d tokens differ)",
                       check.request_id, differ, check.first + 1 + differ, check.reported[differ], scored[differ],
                       sum(a != b for a, b in zip(check.reported, scored)), len(check.reported))
        return Verdict.MISMATCH
