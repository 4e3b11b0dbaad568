"""How many drafts each request gets this step: K from measured acceptance and measured step cost.

A draft pays when the tokens it is expected to add are worth more than the time it costs. Both sides are
measured by the engine as it runs, never assumed:

- **Acceptance**, per request: each verified draft position is a Bernoulli trial (the first rejection ends
  the run), so ``a = accepted / (accepted + rejections)`` with decayed counts (:data:`REQUEST_DECAY` per
  verify) and the engine-wide rate as the prior of a new request. With per-token acceptance ``a``, a row
  with ``K`` drafts emits ``1 + a + a^2 + ... + a^K`` tokens on average.
- **Proposals**, per request: the share of offers of ``K > 0`` the proposer answered with drafts (prompt
  lookup answers only where the request repeats itself: 1 offer in 30 for sampled text of the benchmark's
  pair), decayed like acceptance, with the engine-wide share as the prior (1 at first). A row's expected
  gain is that share times the tokens its drafts bring: an offer costs a verify step whether or not it
  is answered.
- **Cost**, per batch-size bucket (powers of two): what an engine step whose rows all decode costs (CPU
  time on a CPU, where the wall clock also counts whoever else shares the cores; wall time on an
  accelerator, where the host waits for the device): ``plain`` for a step without drafts (overlapped,
  measured after a step like it; while every step drafts, two plain steps every :data:`PLAIN_REFRESH` verify
  steps measure it again), and ``plain + fixed + slope * mean K`` for a verify step with drafts,
  by decayed least squares (:data:`COST_DECAY` per step). A verify step whose proposer drafted nothing is
  not counted: it is neither.
  ``fixed`` is the price of drafting at all (a drafter forward, a sampler pass per depth, prefill-shaped
  attention; a probe of 16 of 64 rows at K = 1 cost 2.7x a plain step on the CPU with the benchmark's
  trained draft); ``slope / plain`` is what one more draft per row costs relative to a step without drafts: small at batch 1 on a GPU (the forward is bound by reading the
  weights, extra query rows are almost free), near 1 or more at a large batch or on a CPU, where every row
  costs compute and the drafter's forwards and the sampler's passes per depth come on top.

The choice maximizes tokens per second of step, ``N / D`` with ``N = B + sum_i f_i sum_{j<=K_i} a_i^j`` and
``D = plain + fixed + slope * sum_i K_i / B`` (``D = plain`` without drafts), by Dinkelbach's iteration:
at the current rate ``r = N / D`` a row takes its ``j``-th draft when ``f_i * a_i^j >= r * slope / B`` (``f_i``
its proposal share: the tokens the draft brings beat the time it costs at that rate), the step drafts at all
only if the drafts' tokens beat ``r * (fixed + ...)``, then ``r`` is recomputed; a few rounds converge. A request that is rarely accepted,
or a batch where rows cost as much as they save, gets ``K = 0``: no drafts, and no drafter forward.

Measuring needs data: a bucket with fewer than :data:`PLAIN_NEEDED` steps without drafts (besides its first
:data:`PLAIN_COLD`, which run cold) runs them; one with no step with drafts runs
probes until one drafted (an n-gram probe may find no match: it then costs about a plain step):
``K = 1`` for a sixteenth of the rows (at least one), then the most ``K`` for those rows, of which only the
second step is measured (in the first a draft model catches up on the tokens it did not see while K was
0; at the most K, the cost line is not all slope from a ``K = 1`` step, whose fixed cost of a verify step,
1.3x a plain one on the CPU, read as per-draft cost declined K = 4, which pays). While the choice
stays 0 the estimates would go stale (acceptance is only measured when drafting), so a probe runs every
``probe`` steps without drafts: 16 at first, doubling while probes change nothing (up to 256), and never
more often than keeps probes (both steps) within :data:`PROBE_BUDGET` of the time, once the engine-wide
acceptance rests on :data:`CONFIDENT_TRIALS` verified drafts (before, a decline may be a few unlucky
guesses). A step measured at more than 1.5x the model's prediction counts as 1.5x: the shared CPU
deschedules the step thread now and then (1 step in 20 took 6x on the 2-core machine), which says nothing
about drafting. While a decline stands and no probe or rule run is due, the engine does not ask the policy
at all (:meth:`AdaptiveK.restful_steps`) and reports the steps afterwards (:meth:`AdaptiveK.rested`).

A bucket without a model of its own borrows the nearest bucket's (costs relative to a plain step change
little from one power of two to the next, and a batch that shrinks as its requests finish should not
probe again at each size); it measures its own with its probes.

Limits: ``fixed`` and ``slope`` are told apart only once steps with drafts had different mean K (n-gram
proposals vary by themselves; a draft model's vary with the per-request K); before that all is slope,
read at the most K (optimistic for a smaller K, corrected as the steps it then runs are measured). Where a
probe costs as much as above, the first one at each batch size costs about a step and a half, which a
64-step run notices and a long one does not.

``adaptive: false`` (:class:`PinnedK`) drafts ``num_speculative_tokens`` every step, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: weight kept by a request's acceptance counts at each of its verify steps (about the last 5 steps count)
REQUEST_DECAY = 0.8
#: weight kept by the engine-wide acceptance counts at each verified row (the prior of a new request; about
#: the last 20 rows count)
GLOBAL_DECAY = 0.95
#: weight kept by a bucket's cost samples at each measured step (about the last 50 steps count)
COST_DECAY = 0.98
#: the acceptance an engine assumes before anything was verified, and its weight in trials; also the weight of
#: the engine-wide share of offers answered in a request's own share (prompt lookup finds text in one request
#: and not in the next: a request's own offers soon outweigh it)
PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.5, 2.0
#: the weight in trials of the engine-wide acceptance in a request's own. A declined request verifies nothing,
#: so its estimate stays where its last verify left it: with a weight of 2, one guess rejected at the first
#: position (1 time in 12 at 92% acceptance) took a request from 0.92 to 0.61, below what a verify step's fixed
#: cost needs, for the rest of its life; with 6 it leaves 0.79
REQUEST_PRIOR_TRIALS = 6.0
PROBE_MIN, PROBE_MAX = 16, 256
#: rows that draft (K = 1) in a probe: a sixteenth of the batch, at least one. Few, because a draft model
#: first catches up on every token a probing row generated since it last drafted (16 rows of 64 after 200
#: steps without drafts: a 3200-token drafter prefill, 18.8 ms against 2.2 ms for a plain step on the CPU)
PROBE_SHARE = 16
#: the share of the time probes may cost while K stays 0 (their interval grows to keep within it)
PROBE_BUDGET = 0.005
#: the engine-wide acceptance's weight in verified drafts (decayed by :data:`GLOBAL_DECAY` a verified row) below
#: which a decline is not trusted for long: probes come every ``probe`` steps, outside the budget. One probe's five
#: guesses, one rejected, read 0.72 for the benchmark's greedy pair (about 0.9, and drafting at K = 4 gains 9%), and
#: the budget put the next probe 850 steps away: a long-lived engine drafted 4 steps in 1,800, at 0.975 of none
CONFIDENT_TRIALS = 10.0
#: steps a declined choice stands before the rule runs again for the same rows, unless news came
#: (a verified draft or a proposal: only verify steps bring them): the rule's 13 us at 64 rows was 0.4% of a
#: 3.4 ms CPU step of the benchmark's pair. Doubling while the rule declines again (only ``plain``'s samples
#: moved), up to :data:`RECHECK_MAX`: in the engine, between torch's kernels, the rule run every 9th step was half
#: of the 2.6 us a step the policy cost at batch 1 while it declined
RECHECK, RECHECK_MAX = 8, 64
#: while K stays 0, plain steps are timed in runs of this many, one sample their mean (two clock reads and one cost
#: update a run). In the engine, between torch's kernels, a clock read cost 1.5 us and a cost update 3.3: timing
#: every plain step made a declined speculator 2% slower than none at batch 1 (635 against 616 us a step); timing
#: one in 8 alone, 1% (a plain step's decayed mean needs no more than a run's mean)
PLAIN_SAMPLE = 8
#: while every step drafts, two steps without drafts after this many measured verify steps of a bucket, so that
#: what a plain step costs is measured again (about 3% of the steps: where drafting gains 15%, 0.5% of the time)
PLAIN_REFRESH = 64
#: a batch size's first steps without drafts, left out of its model: they run cold. A fresh engine's decode steps
#: at batch 1 on the CPU took 1.5, 1.0, 0.84, 0.71 ms, then 0.6-0.7 (at 64: 21, 3.3, 2.2, then 2.0-2.1). Kept, the
#: first ones made a plain step look 0.84 ms where it took 0.6, and drafting cheap: a verify step of the draft model
#: at K = 1 (1.2-1.4 ms, 1.6 tokens at sampled text's acceptance) looked like a gain until plain steps were measured
#: again, 64 verify steps later (sampled text, concurrency 1: 98 verify steps in 420, 0.93 of no speculation)
PLAIN_COLD = 4
#: steps without drafts a batch size's model needs, besides the cold ones, before drafts are weighed against them
PLAIN_NEEDED = 3
#: a measured step longer than this many times the model's prediction is counted at that (a descheduled
#: thread or a page fault says nothing about drafting; on the shared 2-core CPU, 1 step in 20 took 6x)
OUTLIER = 1.5


class PinnedK:
    """``adaptive: false``: every request that may speculate is offered ``num_speculative_tokens`` drafts."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    def choose(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """K per request: ``max_k``, less where the request's length limit leaves less room (``caps``)."""
        return [min(self.max_k, cap) for cap in caps]

    def proposed(self, request_id: str, drafts: int) -> None:
        """Nothing to learn: K is pinned."""

    def unanswered(self) -> None:
        """Nothing to learn: K is pinned."""

    def times_step(self, drafting: bool) -> int:
        """No step is timed: K is pinned."""
        return 0

    def restful_steps(self) -> int:
        """K is pinned: every step may draft."""
        return 0

    def rested(self, steps: int) -> None:
        """Never rests."""

    def verified(self, request_id: str, drafts: int, accepted: int) -> None:
        """Nothing to learn: K is pinned."""

    def step_cost(self, batch_size: int, draft_tokens: int, seconds: float) -> None:
        """Nothing to learn: K is pinned."""

    def forget(self, request_id: str) -> None:
        """Nothing kept per request."""


@dataclass
class _Rate:
    """Decayed Bernoulli counts: ``hits / trials``."""

    hits: float = 0.0
    trials: float = 0.0

    def add(self, hits: float, trials: float, decay: float) -> None:
        self.hits = self.hits * decay + hits
        self.trials = self.trials * decay + trials


@dataclass
class _Cost:
    """One batch-size bucket's step cost: ``plain`` (decayed mean of steps without drafts) and, for steps
    with drafts, ``plain + fixed + slope * x`` by decayed least squares on the mean drafts per row ``x``."""

    pw: float = 0.0  # steps without drafts: weight and sum of seconds
    py: float = 0.0
    w: float = 0.0  # steps with drafts: weight and sums
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    model: tuple[float, float, float] | None = None  # :meth:`fit`'s answer, kept until the next sample
    stale: int = 0  # steps with drafts measured since the last step without
    plains: int = 0  # steps without drafts measured (the first :data:`PLAIN_COLD` are not kept)

    @property
    def without_drafts(self) -> bool:
        """Enough steps without drafts were measured to weigh drafts against (:data:`PLAIN_NEEDED`)."""
        return self.plains >= PLAIN_COLD + PLAIN_NEEDED

    def add(self, x: float, y: float) -> None:
        """A measured step. Every sample ages both sides' sums, so that each side is a mean over recent steps
        even where its samples are rare (a plain step among many verify steps: the first plain sample of a
        run, 0.78 ms where 0.6 was the rule, had stayed the estimate of a whole run that drafted every step)."""
        if x == 0 and self.plains < PLAIN_COLD:  # a batch size's first plain steps run cold: left out
            self.plains += 1
            return
        d, self.model = COST_DECAY, None
        self.pw, self.py = self.pw * d, self.py * d
        self.w, self.x, self.y, self.xx, self.xy = self.w * d, self.x * d, self.y * d, self.xx * d, self.xy * d
        if x == 0:
            self.pw, self.py, self.stale, self.plains = self.pw + 1, self.py + y, 0, self.plains + 1
        else:
            self.w, self.x, self.y = self.w + 1, self.x + x, self.y + y
            self.xx, self.xy, self.stale = self.xx + x * x, self.xy + x * y, self.stale + 1

    def fit(self) -> tuple[float, float, float] | None:
        """``(plain, fixed, slope)``, or None until steps with and without drafts were both measured. While
        the steps with drafts all had one ``x``, ``fixed`` and ``slope`` cannot be told apart: all is slope
        (the pessimistic reading for larger K). Kept until the next sample: the policy reads it every step."""
        if self.model is None and self.without_drafts and self.w:
            self.model = self._solve()
        return self.model

    def _solve(self) -> tuple[float, float, float]:
        """Decayed least squares of the steps with drafts, against the mean of those without."""
        plain = self.py / self.pw
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        slope = (self.xy / self.w - mx * my) / var if var > 1e-9 * mx * mx else -1.0
        if slope < 0:  # one x only, or noise: a line through plain
            return plain, 0.0, max(my - plain, 0.0) / mx
        return plain, max(my - slope * mx - plain, 0.0), slope

    def predict(self, x: float) -> float | None:
        """The model's seconds for a step at mean K ``x`` (None: not fitted yet; a step without drafts needs
        only the mean of such steps)."""
        if x == 0:
            return self.py / self.pw if self.without_drafts else None
        model = self.fit()
        if model is None:
            return None
        plain, fixed, slope = model
        return plain + fixed + slope * x


def bucket(batch_size: int) -> int:
    """Batch sizes of one power of two share a cost model (1, 2-3, 4-7, ...)."""
    return max(batch_size, 1).bit_length()


@dataclass
class AdaptiveK:
    """The per-engine K policy (see the module docstring); each engine of a fleet keeps its own."""

    max_k: int
    requests: dict[str, _Rate] = field(default_factory=dict)
    overall: _Rate = field(default_factory=lambda: _Rate(PRIOR_ACCEPTANCE * PRIOR_TRIALS, PRIOR_TRIALS))
    finds: dict[str, _Rate] = field(default_factory=dict)  # per request: offers of K > 0 the proposer answered
    found: _Rate = field(default_factory=lambda: _Rate(PRIOR_TRIALS, PRIOR_TRIALS))  # engine-wide, their prior
    costs: dict[int, _Cost] = field(default_factory=dict)
    probe: int = PROBE_MIN  # steps without drafts before the next probe
    idle: int = 0  # steps without drafts since the last step with some
    probing: bool = False
    follow: bool = False  # the next step is a probe's second, measured step
    untimed: bool = False  # the next measured step is a probe's first: its cost is not recorded
    warmup: float = 0.0  # what the last probe's first step cost beyond a plain step, over a plain step
    quiet: int = 0  # steps left before a declined choice is weighed again
    recheck: int = RECHECK  # steps the next declined choice stands (:data:`RECHECK`, doubling while it declines)
    quiet_for: tuple[list[str], float] = ([], 0.0)  # the rows it was declined for, and a probe's excess cost

    def acceptance(self, request_id: str) -> float:
        """The request's per-draft acceptance estimate, with the engine-wide rate as its prior."""
        return _estimates(self.requests, self.overall, [request_id], REQUEST_PRIOR_TRIALS)[0]

    def choose(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """K per request (each at most ``min(max_k, cap)``) for a step of ``len(request_ids)`` decode rows."""
        size = len(request_ids)
        if not size:
            return []
        if self.follow:  # a probe's second step: the drafter has caught up, this one is measured, at the most K
            self.follow = False
            return self._probe_rows(caps, self.max_k)
        if self.quiet and self.quiet_for[0] == request_ids:  # declined a moment ago for these rows: it stands
            self.quiet -= 1
            return self._idle(caps, self.quiet_for[1])
        cost = self.costs.setdefault(bucket(size), _Cost())
        model = cost.fit() or self._neighbour(bucket(size))
        if model is None:  # measure first: steps without drafts, then probes until one drafted (n-gram may
            return self._start_probe(caps) if cost.without_drafts else [0] * size  # find nothing: cheap)
        plain, fixed, slope = model
        rates = _estimates(self.requests, self.overall, request_ids, REQUEST_PRIOR_TRIALS)
        finds = _estimates(self.finds, self.found, request_ids, PRIOR_TRIALS)
        # a probe's measured step (its rows at the most K), over a plain one: the second step of :meth:`_start_probe`
        excess = (fixed + slope * self.max_k * max(1, size // PROBE_SHARE) / size) / plain
        rate = size / plain
        if max(f * a for f, a in zip(finds, rates)) < rate * slope / size:  # not even one draft pays: the loop's
            return self._decline(request_ids, caps, excess)  # first round, in one pass
        caps = [min(self.max_k, cap) for cap in caps]
        ks = [0] * size
        for _ in range(8):  # Dinkelbach: the best drafts at the current rate, then the new rate
            threshold = rate * slope / size
            new = [_best_k(a, cap, threshold / f) if f > 0 else 0 for a, f, cap in zip(rates, finds, caps)]
            extra = sum(f * _expected_extra(a, k) for a, f, k in zip(rates, finds, new))
            if extra <= rate * (fixed + slope * sum(new) / size):  # not worth drafting at all (fixed included)
                new, extra = [0] * size, 0.0
            seconds = plain + (fixed + slope * sum(new) / size if any(new) else 0.0)
            rate, converged = (size + extra) / seconds, new == ks
            ks = new
            if converged:
                break
        if not any(ks):
            return self._decline(request_ids, caps, excess)
        self.idle, self.probe, self.probing, self.recheck = 0, PROBE_MIN, False, RECHECK
        if cost.stale >= PLAIN_REFRESH:  # a step without drafts now and then keeps ``plain`` current (two: the
            return [0] * size  # first after a verify step also reads that one, so only the second is measured)
        return ks

    def _decline(self, request_ids: list[str], caps: list[int], excess: float) -> list[int]:
        """K = 0 for every row (or a probe, :meth:`_idle`); the choice stands ``recheck`` steps, twice as many
        the next time unless news comes first."""
        self.quiet, self.quiet_for = self.recheck, (request_ids, excess)
        self.recheck = min(2 * self.recheck, RECHECK_MAX)
        return self._idle(caps, excess)

    def _neighbour(self, home: int) -> tuple[float, float, float] | None:
        """The model of the nearest bucket that has one (the larger on a tie), as this bucket's until it has
        its own: costs relative to a plain step change little from one power of two to the next, and a batch
        that shrinks as its requests finish should not probe again at each size."""
        fitted = [(abs(b - home), -b, model) for b, c in self.costs.items() if (model := c.fit()) is not None]
        return min(fitted)[2] if fitted else None

    def _idle(self, caps: list[int], excess: float) -> list[int]:
        """No drafts this step, or a probe: every ``probe`` steps, the interval doubling while probes change
        nothing, and never more often than keeps probing (a first step costing ``warmup`` more than a plain
        one, a second costing ``excess`` more) within :data:`PROBE_BUDGET` of the time."""
        if self.probing:  # the last probe did not change the choice: wait twice as long for the next
            self.probe, self.probing = min(2 * self.probe, PROBE_MAX), False
        self.idle += 1
        if self.idle < self._probe_interval(excess):
            return [0] * len(caps)
        self.idle, self.probing = 0, True
        return self._start_probe(caps)

    def _probe_interval(self, excess: float) -> float:
        """Steps without drafts between probes: ``probe``, and, once the engine-wide acceptance rests on
        :data:`CONFIDENT_TRIALS` verified drafts, as many as keep probing within :data:`PROBE_BUDGET` (on thin
        evidence a decline may be a few unlucky guesses)."""
        if self.overall.trials < CONFIDENT_TRIALS:
            return self.probe
        return max(self.probe, (excess + self.warmup) / PROBE_BUDGET)

    def restful_steps(self) -> int:
        """After a step that declined every row: how many next steps decline too, for the same rows, with no rule
        run and no probe (:meth:`choose` would only count them). The engine then skips the policy for them and
        reports them together (:meth:`rested`): in the engine, between torch's kernels, the policy's calls cost
        7 us a step at batch 1 while it declined (1.1% of a CPU step of the benchmark's pair)."""
        if not self.quiet or self.follow:
            return 0
        return max(0, min(self.quiet, math.ceil(self._probe_interval(self.quiet_for[1])) - self.idle - 1))

    def rested(self, steps: int) -> None:
        """``steps`` steps of :meth:`restful_steps` ran without the policy: counted as :meth:`choose` counts a
        standing decline."""
        self.quiet -= steps
        self.idle += steps

    def _start_probe(self, caps: list[int]) -> list[int]:
        """A probe is two steps: the first catches the drafter up on the tokens it missed (a draft model
        recomputes them: not what a step costs while drafting), the second is measured."""
        self.follow = self.untimed = True
        self.quiet = 0  # what the probe measures is weighed at once
        return self._probe_rows(caps, 1)

    def _probe_rows(self, caps: list[int], k: int) -> list[int]:
        """K = ``k`` for the first ``1 / PROBE_SHARE`` of the rows (at least one), 0 for the others."""
        rows = max(1, len(caps) // PROBE_SHARE)
        return [min(k, self.max_k, cap) if i < rows else 0 for i, cap in enumerate(caps)]

    def times_step(self, drafting: bool) -> int:
        """How this step's cost is wanted (``drafting``: some request was given drafts): 1, alone (a step with
        drafts, and a plain one while nothing was declined since the last drafts: a batch size being measured, a
        refresh of ``plain`` while every step drafts); while K stays 0, as one of a run of :data:`PLAIN_SAMPLE`
        plain steps timed together (:meth:`~.decoder.Speculator.end_step`)."""
        return 1 if drafting or not self.idle else PLAIN_SAMPLE

    def proposed(self, request_id: str, drafts: int) -> None:
        """A request was offered K > 0 and the proposer gave ``drafts`` (0: n-gram found no match; a grammar cut
        them all): the share of offers answered scales what its drafts are expected to bring."""
        self.quiet, self.recheck = 0, RECHECK  # news: weigh afresh
        self.finds.setdefault(request_id, _Rate()).add(float(drafts > 0), 1.0, REQUEST_DECAY)
        self.found.add(float(drafts > 0), 1.0, GLOBAL_DECAY)

    def unanswered(self) -> None:
        """No offer of this step was answered. A probe's first step that drafted nothing ends the probe: its
        second step (for a draft model caught up; n-gram needs no catching up) would find nothing to measure
        either (n-gram without a match; halves what such probes cost)."""
        self.follow = self.untimed = False

    def verified(self, request_id: str, drafts: int, accepted: int) -> None:
        """A request's ``drafts`` were verified and ``accepted`` kept: ``accepted`` trials passed, one failed
        unless all were accepted."""
        if not drafts:
            return
        self.quiet, self.recheck = 0, RECHECK  # news: weigh afresh
        trials = accepted + (accepted < drafts)
        self.requests.setdefault(request_id, _Rate()).add(accepted, trials, REQUEST_DECAY)
        self.overall.add(accepted, trials, GLOBAL_DECAY)

    def step_cost(self, batch_size: int, draft_tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` decode rows and ``draft_tokens`` drafts took ``seconds`` (draft to verified)."""
        if not batch_size:
            return
        cost, x = self.costs.setdefault(bucket(batch_size), _Cost()), draft_tokens / batch_size
        predicted = cost.predict(x)
        if self.untimed:  # a probe's first step: not what drafting costs, but what probing does
            plain = cost.py / cost.pw if cost.pw else None
            self.untimed, self.warmup = False, max(seconds / plain - 1, 0.0) if plain else 0.0
            return
        cost.add(x, seconds if predicted is None else min(seconds, OUTLIER * predicted))

    def forget(self, request_id: str) -> None:
        """The request left the engine."""
        self.requests.pop(request_id, None)
        self.finds.pop(request_id, None)


def _estimates(own: dict[str, _Rate], overall: _Rate, request_ids: list[str], weight: float) -> list[float]:
    """Each request's rate from its own decayed counts, with the engine-wide rate as a prior of ``weight``
    trials."""
    mean = overall.hits / overall.trials
    return [(rate.hits + weight * mean) / (rate.trials + weight) if (rate := own.get(r)) is not None
            else mean for r in request_ids]


def _expected_extra(a: float, k: int) -> float:
    """Tokens beyond the first that ``k`` drafts accepted with probability ``a`` each (in a row) add."""
    return sum(a ** j for j in range(1, k + 1))


def _best_k(a: float, cap: int, threshold: float) -> int:
    """The longest prefix of drafts whose ``j``-th one is accepted with probability ``a^j >= threshold``."""
    k = 0
    while k < cap and a ** (k + 1) >= threshold:
        k += 1
    return k
