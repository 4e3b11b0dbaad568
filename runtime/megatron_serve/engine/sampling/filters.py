"""The ops of the sampling table's ``FILTER`` rows: what a sampled row's logits go through before its draw.

One entry of :data:`FILTER_OPS` per op, naming the table's ``sampler`` inputs it reads: :func:`filtered_logits`
runs an op only where some row of the step sets one of them off its neutral value (the sampler's fast path asks
no flag of its own per filter), and the step (``sampler.Sampler.launch``), the lone-row replay of the parity
checker (``Sampler.processed_alone``) and the processed log probs all go through it. So a new filter is its row
in ``wire/sampling_fields.py`` and its entry here: ``tests/engine/test_sampling_filters.py`` holds that every
``FILTER`` row has exactly one op.

Each op reads ``[rows]`` device vectors of its inputs and changes each row from that row alone; a row whose
input is neutral comes out as it went in, so rows that do not use a filter are untouched by a step that does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...wire.sampling_fields import FILTERS, SamplingField


@dataclass(frozen=True)
class FilterRows:
    """What the filters read of a step's rows: each sampler input's ``[rows]`` device vector by name (``value``),
    the inputs some row sets off their neutral value (``used``), and the largest top-k of the rows that sample
    (host-side, so top-k alone needs only the k largest values)."""

    value: Callable[[str], torch.Tensor]
    used: frozenset[str]
    max_top_k: int


FilterOp = Callable[[torch.Tensor, FilterRows], torch.Tensor]


def _temperature(logits: torch.Tensor, rows: FilterRows) -> torch.Tensor:
    """Over the row's temperature (a greedy row's slot holds 1: x / 1.0 is x)."""
    return logits / rows.value("temperature")[:, None]


def _min_p(scaled: torch.Tensor, rows: FilterRows) -> torch.Tensor:
    """Drops tokens less likely than ``min_p`` times the most likely one (before top-k and top-p: vLLM's order)."""
    probs = scaled.softmax(-1)
    return scaled.masked_fill(probs < rows.value("min_p")[:, None] * probs.amax(-1, keepdim=True), float("-inf"))


def _sorted_descending(values: torch.Tensor) -> torch.Tensor:
    """Each row of ``values`` sorted, largest first (values only: no indices are needed).

    On a CPU, torch's sort took 3.4 ms for 64 rows of 512 and numpy's in-place sort (SIMD) 0.12 ms; it sorts
    the negated copy through a numpy view of its memory (no tensor built from Python data).
    """
    if values.device.type != "cpu":
        return torch.sort(values, dim=-1, descending=True).values
    negated = (-values).contiguous()
    negated.numpy().sort(axis=-1)
    return negated.neg_()


def _top_k_top_p(scaled: torch.Tensor, rows: FilterRows) -> torch.Tensor:
    """Top-k keeps every token at least as likely as the k-th (ties stay; 0: off); top-p then keeps the most likely
    tokens until the mass strictly before the next one reaches ``top_p`` (the most likely token always stays, even
    for a subnormal ``top_p``), and every token as likely as the last kept (ties stay). Both are thresholds on the
    row's sorted values, so one op: only a step with a top-p row sorts, and top-k alone takes the k largest."""
    top_k = rows.value("top_k")
    vocab = scaled.shape[-1]
    k_active = (top_k > 0)[:, None]
    kth_index = (top_k.clamp(min=1, max=vocab) - 1)[:, None]
    if "top_p" not in rows.used:
        width = min(rows.max_top_k, vocab)
        kth = torch.topk(scaled, width).values.gather(1, kth_index.clamp(max=width - 1))
        return scaled.masked_fill((scaled < kth) & k_active, float("-inf"))
    top_p = rows.value("top_p")
    ordered = _sorted_descending(scaled)
    kth = ordered.gather(1, kth_index)
    below_k = (scaled < kth) & k_active
    probs = ordered.masked_fill((ordered < kth) & k_active, float("-inf")).softmax(-1)
    kept = ((probs.cumsum(-1) - probs) < top_p[:, None]) | (top_p >= 1.0)[:, None]
    kept[:, 0] = True
    last = ordered.gather(1, kept.sum(-1, keepdim=True) - 1)  # kept is a prefix of the sorted row
    return scaled.masked_fill(below_k | (scaled < last), float("-inf"))


def _typical_p(scaled: torch.Tensor, rows: FilterRows) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022; transformers' ``TypicalLogitsWarper``, TGI's and
    llama.cpp's ``typical_p``): keeps the tokens whose surprisal is closest to the row's entropy, in that order,
    until their mass reaches ``typical_p`` (the token it reaches it with stays, with its ties). The same ops as
    transformers', so a row's result is theirs bit for bit; a row at 1 (off) is left as it is."""
    mass = rows.value("typical_p")[:, None]
    normalized = torch.log_softmax(scaled, dim=-1)
    entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
    shifted = (-normalized - entropy).abs()
    ordered, order = torch.sort(shifted, descending=False)
    cumulative = scaled.gather(-1, order).softmax(-1).cumsum(-1)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp_(max=shifted.shape[-1] - 1)
    return scaled.masked_fill((shifted > ordered.gather(1, last)) & (mass < 1.0), float("-inf"))


#: The filters in the order they apply (temperature, then vLLM's min-p, top-k, top-p; then transformers' typical),
#: each with the table's ``sampler`` inputs it reads.
FILTER_OPS: tuple[tuple[frozenset[str], FilterOp], ...] = (
    (frozenset({"temperature"}), _temperature),
    (frozenset({"min_p"}), _min_p),
    (frozenset({"top_k", "top_p"}), _top_k_top_p),
    (frozenset({"typical_p"}), _typical_p),
)


def filtered_logits(logits: torch.Tensor, rows: FilterRows) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` through every filter some row uses (``logits`` itself where none does); what a
    filter drops is -inf. Each row's result depends on that row alone."""
    for inputs, op in FILTER_OPS:
        if not rows.used.isdisjoint(inputs):
            logits = op(logits, rows)
    return logits


def _vector_of(row: SamplingField, value: object, count: int, device: torch.device) -> torch.Tensor:
    return torch.full((count,), value, dtype=torch.float32 if row.kind is float else torch.int64, device=device)


def lone_rows(params: object, count: int, device: torch.device) -> FilterRows:
    """The filters' view of ``count`` rows that all sample with ``params`` (a ``SamplingParams``), as a step's slots
    hold them: the same vectors' values, so :func:`filtered_logits` processes them as in a step."""
    values = {row.sampler: getattr(params, row.name) for row in FILTERS}
    vectors = {row.sampler: _vector_of(row, values[row.sampler], count, device) for row in FILTERS}
    used = frozenset(row.sampler for row in FILTERS if values[row.sampler] != row.default)
    return FilterRows(vectors.__getitem__, used, max(int(values["top_k"]), 0))  # type: ignore[index]
