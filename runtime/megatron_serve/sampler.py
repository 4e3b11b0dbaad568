"""Choosing the next token of each request from its logits, and the log probs users asked for.

A request with a seed draws from a generator seeded by (seed, token index), so its samples do not
depend on which other requests share the batch, on preemption, or on the engine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    log_probs: list[float | None]
    top_n: list[dict[int, float] | None]


def _seeded_generator(seed: int, token_index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + token_index) % (2**63 - 1))
    return generator


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass strictly before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False  # even a subnormal top_p (0 in float32) keeps the most likely token
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> SampleResult:
        """``logits`` ``[n, vocab]`` float32; ``token_indices[i]``: how many tokens request ``i`` generated so far."""
        tokens = torch.argmax(logits, dim=-1)
        for row, sp in enumerate(params):
            if sp.is_greedy:
                continue
            scaled = _filter_top_k_top_p(logits[row] / sp.temperature, sp.top_k, sp.top_p)
            generator = (self._generator if sp.seed is None
                         else _seeded_generator(sp.seed, token_indices[row], logits.device))
            probs = scaled.softmax(-1)
            if not bool(torch.isfinite(probs).all()):
                continue  # degenerate filter settings: keep the greedy choice rather than fail the batch
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
        token_list = tokens.tolist()
        log_probs: list[float | None] = [None] * len(params)
        top_n: list[dict[int, float] | None] = [None] * len(params)
        wanted = [row for row, sp in enumerate(params) if sp.return_log_probs or sp.top_n_logprobs]
        if wanted:
            all_log_probs = torch.log_softmax(logits[wanted], dim=-1)
            for position, row in enumerate(wanted):
                row_log_probs = all_log_probs[position]
                log_probs[row] = float(row_log_probs[token_list[row]])
                n = params[row].top_n_logprobs
                if n:
                    values, ids = torch.topk(row_log_probs, n)
                    top_n[row] = dict(zip(ids.tolist(), values.tolist()))
        return SampleResult(token_list, log_probs, top_n)
