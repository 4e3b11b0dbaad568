"""Choosing the next token of each request from its logits, and the log probs users asked for.

A request with a seed draws from a generator seeded by (seed, token index), so its samples do not
depend on which other requests share the batch, on preemption, or on the engine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..wire.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    log_probs: list[float | None]
    top_n: list[dict[int, float] | None]


@dataclass
class TokenScores:
    """Log probs of given tokens, and the ``top_n`` most likely tokens at each row (best first)."""

    log_probs: list[float]
    top_ids: list[list[int]]
    top_log_probs: list[list[float]]

    def top(self, row: int, n: int) -> dict[int, float]:
        return dict(zip(self.top_ids[row][:n], self.top_log_probs[row][:n]))


class Readback:
    """Device tensors on their way to the host: copied without blocking when launched, read by ``wait``.

    The step that produced them is not waited for at launch, so the host can prepare and launch the
    next step meanwhile (overlapped scheduling); on a GPU the copies land in pinned memory and an
    event says when they are there. Off CUDA the tensors are already on the host.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        if tensors and tensors[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, tensor in zip(self._host, tensors):
                host.copy_(tensor, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tensors, None

    def wait(self) -> list[list]:
        """The tensors' values as nested lists (blocks until the device has produced them)."""
        if self._ready is not None:
            self._ready.synchronize()
        return [t.tolist() for t in self._host]


@dataclass
class DeviceScores:
    """``score_tokens``' results still on the device; ``read`` brings them to the host."""

    readback: Readback
    top_n: int

    def read(self) -> TokenScores:
        values = self.readback.wait()
        return TokenScores(values[0], *(values[1:] if self.top_n else ([], [])))


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> DeviceScores:
    """Log-softmax of each row of ``logits``, read at ``targets`` (one token per row) and at its top ``top_n``."""
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(1, targets[:, None]).squeeze(1)
    if not top_n:
        return DeviceScores(Readback([chosen]), 0)
    values, ids = torch.topk(log_probs, min(top_n, log_probs.shape[-1]))
    return DeviceScores(Readback([chosen, ids, values]), top_n)


@dataclass
class DeviceSample:
    """A step's sampled tokens on the device (the next step reads them there) and their way to the host."""

    tokens: torch.Tensor  # [rows] int64
    readback: Readback
    scores: DeviceScores | None  # log probs of the rows in ``wanted``
    wanted: list[int]
    top_n: list[int]  # per row, how many top log probs it asked for

    def read(self) -> SampleResult:
        token_ids = self.readback.wait()[0]
        log_probs: list[float | None] = [None] * len(token_ids)
        top_n: list[dict[int, float] | None] = [None] * len(token_ids)
        if self.scores is not None:
            scores = self.scores.read()
            for position, row in enumerate(self.wanted):
                log_probs[row] = scores.log_probs[position]
                if self.top_n[row]:
                    top_n[row] = scores.top(position, self.top_n[row])
        return SampleResult(token_ids, log_probs, top_n)


def _seeded_generator(seed: int, token_index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + token_index) % (2**63 - 1))
    return generator


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row-wise softmax of ``logits / temperature`` restricted by each row's top-k and top-p.

    Min-p first drops tokens less likely than ``min_p`` times the most likely one (vLLM's order).
    Top-k keeps every token at least as likely as the k-th (ties stay); top-p then drops a token
    once the mass strictly before it reaches ``top_p`` (the most likely token always stays, even for
    a subnormal ``top_p``). Only a batch with a top-p row pays for a full sort; top-k alone needs
    the k largest values only. Each row's result depends on that row alone.
    """
    device = logits.device
    scaled = logits / torch.tensor([sp.temperature for sp in params], dtype=logits.dtype, device=device)[:, None]
    if any(sp.min_p for sp in params):
        min_p = torch.tensor([sp.min_p for sp in params], dtype=logits.dtype, device=device)[:, None]
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    vocab = scaled.shape[-1]
    top_k = torch.tensor([min(sp.top_k, vocab) for sp in params], dtype=torch.int64, device=device)
    k_active = (top_k > 0)[:, None]
    if all(sp.top_p >= 1.0 for sp in params):
        most = max(sp.top_k for sp in params)
        if most:
            kth = torch.topk(scaled, min(most, vocab)).values.gather(1, (top_k.clamp(min=1) - 1)[:, None])
            scaled = scaled.masked_fill((scaled < kth) & k_active, float("-inf"))
        return scaled.softmax(-1)
    top_p = torch.tensor([sp.top_p for sp in params], dtype=logits.dtype, device=device)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k.clamp(min=1) - 1)[:, None])
    below_k = (sorted_logits < kth) & k_active
    probs = sorted_logits.masked_fill(below_k, float("-inf")).softmax(-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    keep = ~(below_k | drop)
    return scaled.masked_fill(~keep.scatter(1, order, keep), float("-inf")).softmax(-1)


class Sampler:
    """Samples a whole batch with a handful of device ops and one read-back of the results.

    On a GPU, per-row host round trips would cost more than the decode step itself at large batches.
    """

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
               model_logits: torch.Tensor | None = None) -> DeviceSample:
        """Sample every row on the device and start copying the results to the host (nothing waits).

        ``logits`` ``[n, vocab]`` float32; ``token_indices[i]``: how many tokens request ``i`` generated
        before this one. ``model_logits``: the model's own logits when ``logits`` were changed by logit
        controls or a grammar (``logits_processors``); log probs are reported from them, the model's
        distribution, as vLLM reports raw log probs by default.
        """
        tokens = torch.argmax(logits, dim=-1)
        sampled = [row for row, sp in enumerate(params) if not sp.is_greedy]
        if sampled:
            tokens[sampled] = self._draw(logits[sampled], tokens[sampled], [params[r] for r in sampled],
                                         [token_indices[r] for r in sampled])
        wanted = [row for row, sp in enumerate(params) if sp.return_log_probs or sp.top_n_logprobs]
        scores = None
        if wanted:
            source = logits if model_logits is None else model_logits
            scores = score_tokens(source[wanted], tokens[wanted], max(params[row].top_n_logprobs for row in wanted))
        return DeviceSample(tokens, Readback([tokens]), scores, wanted, [sp.top_n_logprobs for sp in params])

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
               model_logits: torch.Tensor | None = None) -> SampleResult:
        """``launch``, then wait for the results on the host."""
        return self.launch(logits, params, token_indices, model_logits).read()

    def _draw(self, logits: torch.Tensor, greedy: torch.Tensor, params: list[SamplingParams],
              token_indices: list[int]) -> torch.Tensor:
        """One token per row; a row whose filter leaves no finite distribution keeps its greedy token.

        Draws by the exponential race, ``argmax(probs / E)`` with ``E ~ Exp(1)`` per token, which
        picks token t with probability ``probs[t]``: a few elementwise ops and no ``multinomial``.
        """
        probs = _filtered_probs(logits, params)
        # A row without a finite distribution becomes all mass on its greedy token (no vocab-sized temporary).
        usable = torch.isfinite(probs).all(-1, keepdim=True)
        probs = probs.masked_fill(~usable, 0.0)
        greedy = greedy[:, None]
        probs.scatter_(1, greedy, torch.where(usable, probs.gather(1, greedy), 1.0))
        noise = torch.empty_like(probs)
        unseeded = [i for i, sp in enumerate(params) if sp.seed is None]
        if len(unseeded) == len(params):
            noise.exponential_(generator=self._generator)
        elif unseeded:
            noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=self._generator)
        for i, sp in enumerate(params):
            if sp.seed is not None:  # its own stream: the draw cannot depend on the rest of the batch
                noise[i].exponential_(generator=_seeded_generator(sp.seed, token_indices[i], probs.device))
        # A zero draw would turn an impossible token's 0 / 0 into NaN, which argmax would pick.
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)
