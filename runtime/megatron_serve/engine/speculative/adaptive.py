"""How many drafts each request gets this step: K from measured acceptance and measured step cost.

A draft pays when the tokens it is expected to add are worth more than the time it costs. Both sides are
measured by the engine as it runs, never assumed:

- **Acceptance**, per request: each verified draft position is a Bernoulli trial (the first rejection ends
  the run), so ``a = accepted / (accepted + rejections)`` with decayed counts (:data:`REQUEST_DECAY` per
  verify) and the engine-wide rate as the prior of a new request. With per-token acceptance ``a``, a row
  with ``K`` drafts emits ``1 + a + a^2 + ... + a^K`` tokens on average.
- **Cost**, per batch-size bucket (powers of two): the time from drafting to the verified tokens of a step
  whose rows are all decode rows, fitted as ``T = plain + slope * mean K`` by decayed least squares
  (:data:`COST_DECAY` per step). ``slope / plain`` is what one more draft per row costs relative to a step
  without drafts: small at batch 1 on a GPU (the forward is bound by reading the weights, the extra query
  rows are almost free), near 1 or more at a large batch or on a CPU, where every row costs compute and the
  drafter's forwards and the sampler's passes per depth come on top.

The choice maximizes tokens per second of step, ``N / D`` with ``N = B + sum_i sum_{j<=K_i} a_i^j`` and
``D = plain + slope * sum_i K_i / B``, by Dinkelbach's iteration: at the current rate ``r = N / D`` a row
takes its ``j``-th draft when ``a_i^j >= r * slope / B`` (the tokens the draft brings beat the time it
costs at that rate), then ``r`` is recomputed; a few rounds converge. A request that is rarely accepted,
or a batch where rows cost as much as they save, gets ``K = 0``: no drafts, and no drafter forward.

Measuring needs data: a bucket with no step without drafts runs one; one with no step with drafts runs
one with ``K = 1`` (a probe). While the choice stays at 0 the model would go stale (acceptance is only
measured when drafting), so every ``probe`` steps without drafts one step drafts ``K = 1``; the interval
doubles each time the probe does not change the choice (16 up to 256 steps), which bounds its cost at a
batch where drafting does not pay: at concurrency 64 on the CPU, where a ``K = 1`` step of the trained
draft model costs about twice a plain one, under 1% once the interval has grown.

``adaptive: false`` (:class:`PinnedK`) drafts ``num_speculative_tokens`` every step, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: weight kept by a request's acceptance counts at each of its verify steps (about the last 5 steps count)
REQUEST_DECAY = 0.8
#: weight kept by the engine-wide acceptance counts at each verified row (the prior of a new request; about
#: the last 20 rows count)
GLOBAL_DECAY = 0.95
#: weight kept by a bucket's cost samples at each measured step (about the last 50 steps count)
COST_DECAY = 0.98
#: the acceptance a request is assumed to have before anything was verified, and its weight in trials
PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.5, 2.0
PROBE_MIN, PROBE_MAX = 16, 256


class PinnedK:
    """``adaptive: false``: every request that may speculate is offered ``num_speculative_tokens`` drafts."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    def choose(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """K per request: ``max_k``, less where the request's length limit leaves less room (``caps``)."""
        return [min(self.max_k, cap) for cap in caps]

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
    """Decayed least squares of step seconds ``y`` on mean drafts per row ``x``: ``y = plain + slope * x``."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    with_drafts: bool = False
    without_drafts: bool = False

    def add(self, x: float, y: float) -> None:
        d = COST_DECAY
        self.w, self.x, self.y = self.w * d + 1, self.x * d + x, self.y * d + y
        self.xx, self.xy = self.xx * d + x * x, self.xy * d + x * y
        self.with_drafts |= x > 0
        self.without_drafts |= x == 0

    def fit(self) -> tuple[float, float] | None:
        """``(plain, slope)``, or None until steps with and without drafts were both measured."""
        if not (self.with_drafts and self.without_drafts):
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var <= 1e-12:
            return None
        slope = (self.xy / self.w - mx * my) / var
        plain = my - slope * mx
        return (plain, max(slope, 0.0)) if plain > 0 else None


def bucket(batch_size: int) -> int:
    """Batch sizes of one power of two share a cost model (1, 2-3, 4-7, ...)."""
    return max(batch_size, 1).bit_length()


@dataclass
class AdaptiveK:
    """The per-engine K policy (see the module docstring); each engine of a fleet keeps its own."""

    max_k: int
    requests: dict[str, _Rate] = field(default_factory=dict)
    overall: _Rate = field(default_factory=lambda: _Rate(PRIOR_ACCEPTANCE * PRIOR_TRIALS, PRIOR_TRIALS))
    costs: dict[int, _Cost] = field(default_factory=dict)
    probe: int = PROBE_MIN  # steps without drafts before the next probe
    idle: int = 0  # steps without drafts since the last step with some
    probing: bool = False

    def acceptance(self, request_id: str) -> float:
        """The request's per-draft acceptance estimate, with the engine-wide rate as its prior."""
        prior = self.overall.hits / self.overall.trials
        own = self.requests.get(request_id, _Rate())
        return (own.hits + PRIOR_TRIALS * prior) / (own.trials + PRIOR_TRIALS)

    def choose(self, request_ids: list[str], caps: list[int]) -> list[int]:
        """K per request (each at most ``min(max_k, cap)``) for a step of ``len(request_ids)`` decode rows."""
        caps = [min(self.max_k, cap) for cap in caps]
        size = len(request_ids)
        if not size:
            return []
        cost = self.costs.setdefault(bucket(size), _Cost())
        model = cost.fit()
        if model is None:  # measure first: a step without drafts, then one with K = 1
            return [min(1, cap) for cap in caps] if cost.without_drafts else [0] * size
        plain, slope = model
        rates = [self.acceptance(r) for r in request_ids]
        ks = [0] * size
        rate = size / plain
        for _ in range(8):  # Dinkelbach: per-row best response at the current rate, then the new rate
            threshold = rate * slope / size
            new = [_best_k(a, cap, threshold) for a, cap in zip(rates, caps)]
            tokens = size + sum(_expected_extra(a, k) for a, k in zip(rates, new))
            rate, converged = tokens / (plain + slope * sum(new) / size), new == ks
            ks = new
            if converged:
                break
        return self._probe(ks, caps)

    def _probe(self, ks: list[int], caps: list[int]) -> list[int]:
        """Every ``probe`` steps chosen without drafts, one with K = 1, at a doubling interval while K stays 0."""
        if any(ks):
            self.idle, self.probe, self.probing = 0, PROBE_MIN, False
            return ks
        if self.probing:  # the last probe did not change the choice: wait twice as long for the next
            self.probe, self.probing = min(2 * self.probe, PROBE_MAX), False
        self.idle += 1
        if self.idle < self.probe:
            return ks
        self.idle, self.probing = 0, True
        return [min(1, cap) for cap in caps]

    def verified(self, request_id: str, drafts: int, accepted: int) -> None:
        """A request's ``drafts`` were verified and ``accepted`` kept: ``accepted`` trials passed, one failed
        unless all were accepted."""
        if not drafts:
            return
        trials = accepted + (accepted < drafts)
        self.requests.setdefault(request_id, _Rate()).add(accepted, trials, REQUEST_DECAY)
        self.overall.add(accepted, trials, GLOBAL_DECAY)

    def step_cost(self, batch_size: int, draft_tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` decode rows and ``draft_tokens`` drafts took ``seconds`` (draft to verified)."""
        if batch_size:
            self.costs.setdefault(bucket(batch_size), _Cost()).add(draft_tokens / batch_size, seconds)

    def forget(self, request_id: str) -> None:
        """The request left the engine."""
        self.requests.pop(request_id, None)


def _expected_extra(a: float, k: int) -> float:
    """Tokens beyond the first that ``k`` drafts accepted with probability ``a`` each (in a row) add."""
    return sum(a ** j for j in range(1, k + 1))


def _best_k(a: float, cap: int, threshold: float) -> int:
    """The longest prefix of drafts whose ``j``-th one is accepted with probability ``a^j >= threshold``."""
    k = 0
    while k < cap and a ** (k + 1) >= threshold:
        k += 1
    return k
