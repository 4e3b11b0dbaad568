"""The step plan: what one engine step computes, written into persistent buffers.

The scheduler's entries ``(sequence, tokens to compute)`` (decode-shaped entries, one token, first)
become one :class:`StepPlan`: per row its token, position and cache slot; per request its block
table and lengths; which rows go through the LM head. The values are written straight into
persistent host buffers (pinned on a GPU, so the copies to the device do not block the host) and
copied into persistent device buffers that every forward reads. No tensor is built from a Python
list per step (building ~7 of them, nested block tables included, cost several ms per step at
batch 256 on the old path), and a CUDA graph captured over the device buffers replays any later
plan that fits its size.

Row layout of a step: ``num_decode`` decode rows (one per request), then the prefill chunks of
``num_prefill`` requests, packed. Requests follow the same order in ``seq_lens`` and
``block_tables``. ``query_start`` holds the prefill chunks' offsets relative to the first prefill
row. ``lm_rows`` lists the rows whose logits are computed: the sampling rows (one per request whose
chunk reaches the end of its known tokens), then the score rows (prompt log probs), then the verify
rows (a speculating request's draft rows before its sampling row, ``engine.speculative``).

Overlapped scheduling: a row whose token is still on the device (sampled by the step in flight)
is listed in ``gather_rows`` with its index in that step's sampled tokens (``gather_from``); the
runner copies those tokens into ``token_ids`` on the device before the forward. That row is the
request's last, or, when the step verifies drafts guessed after the token in flight, its first (the
drafts follow it; ``token_ids`` holds them after the tokens known, the pending token not among them).
When the step in flight is a verify step, the host does not know how many of its drafts each request
accepted: the plan is written as if all were, and ``shift_from`` names each such request's index in
that step, whose rejected-draft count (on the device) the runner subtracts from its positions, length,
cache slots and gather index before the forward (:meth:`~.runner.ModelRunner.run_plan`).

Tensor parallelism: rank 0 packs the used part of the host buffers into one integer array
(:meth:`StepBuffers.pack`) that the other ranks unpack into their own (:meth:`StepBuffers.unpack`):
a broadcast of plain integers, no pickled object per step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch


if TYPE_CHECKING:
    from .encoder_cache import StepImages
    from .sequence import Sequence

#: Name, dtype and shape (in units of tokens ``T``, requests ``R``, blocks per request ``B``) of each buffer.
_BUFFERS: dict[str, tuple[torch.dtype, str]] = {
    "token_ids": (torch.int64, "T"),
    "positions": (torch.int64, "T"),
    "slots": (torch.int64, "T"),
    "seq_lens": (torch.int32, "R"),
    "query_start": (torch.int32, "R+1"),
    "block_tables": (torch.int32, "RxB"),
    "lm_rows": (torch.int64, "T"),
    "gather_rows": (torch.int64, "R"),
    "gather_from": (torch.int64, "R"),
    "shift_from": (torch.int64, "R"),  # each request's index in the verify step in flight; -1: no correction
    "image_rows": (torch.int64, "T"),
    "mrope_positions": (torch.int64, "3xT"),
    "lora_rows": (torch.int64, "T"),  # each row's adapter slot, -1: the base model (engine.lora)
}


@dataclass
class StepPlan:
    """How much of each buffer a step uses; the values themselves are in the :class:`StepBuffers`."""

    num_tokens: int
    num_decode: int  # decode rows, first; one request each
    num_prefill: int  # requests whose chunks follow
    block_width: int  # used columns of the block tables
    num_sample: int  # lm_rows[:num_sample] sample a token
    num_score: int  # lm_rows[num_sample:] score the next prompt token (prompt log probs)
    num_verify: int = 0  # lm_rows after those: the rows of speculative drafts, verified (engine.speculative)
    num_gather: int = 0  # rows whose token is the previous step's sampled token, on the device
    shifted: bool = False  # some request's rows are corrected by the verify step in flight (shift_from)
    num_images: int = 0  # image placeholder rows, whose embeddings come with the step
    mrope: bool = False  # mrope_positions holds three rotary positions per row (Qwen2-VL family)
    record_routing: bool = False  # some sequence records its expert routing (routing replay)
    lora: bool = False  # some row runs under a LoRA adapter: lora_rows holds every row's slot

    @property
    def num_requests(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def decode_only(self) -> bool:
        return self.num_prefill == 0

    @property
    def multimodal(self) -> bool:
        return self.num_images > 0 or self.mrope

    def header(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_header(cls, values: Iterable[int]) -> "StepPlan":
        kinds = [f.type for f in fields(cls)]
        return cls(*[(bool(v) if kind == "bool" else int(v)) for v, kind in zip(values, kinds)])


_HEADER_SIZE = len(fields(StepPlan))


class StepBuffers:
    """Persistent step inputs: host buffers written by :func:`write_plan`, device buffers the forward reads.

    ``max_tokens`` rows, ``max_requests`` requests of up to ``max_blocks`` KV blocks. On CUDA the
    host buffers are pinned and the copies do not block; ``upload`` records an event after them, and
    writing the next plan waits on it (the host must not overwrite values the device has not copied yet).
    """

    def __init__(self, max_tokens: int, max_requests: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_requests, self.max_blocks = max_tokens, max_requests, max_blocks
        self.device = device
        cuda = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (dtype, shape) in _BUFFERS.items():
            size = self._shape(shape)
            self.host[name] = torch.zeros(size, dtype=dtype, pin_memory=cuda)
            self.np[name] = self.host[name].numpy()
            self.dev[name] = self.host[name] if not cuda else torch.zeros(size, dtype=dtype, device=device)
        self._copied: torch.cuda.Event | None = None

    def _shape(self, spec: str) -> tuple[int, ...]:
        return {"T": (self.max_tokens,), "R": (self.max_requests,), "R+1": (self.max_requests + 1,),
                "RxB": (self.max_requests, self.max_blocks), "3xT": (3, self.max_tokens)}[spec]

    def writable(self) -> None:
        """Wait until the device has copied the last plan's host values (a no-op off CUDA)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def pad(self, plan: StepPlan, tokens: int, requests: int) -> None:
        """Make rows ``num_tokens .. tokens`` and requests past the plan's up to ``requests`` padding: no cache
        slot written (slot -1), nothing attended (length 0), no prefill query."""
        n, r = plan.num_tokens, plan.num_requests
        self.np["token_ids"][n:tokens] = 0
        self.np["positions"][n:tokens] = 0
        self.np["slots"][n:tokens] = -1
        self.np["lora_rows"][n:tokens] = -1  # no adapter: read only when the plan has adapter rows
        self.np["seq_lens"][r:requests] = 0
        self.np["query_start"][plan.num_prefill + 1 : requests + 1] = self.np["query_start"][plan.num_prefill]

    def upload(self, plan: StepPlan, tokens: int | None = None, requests: int | None = None) -> None:
        """Copy the plan's values (and padding up to ``tokens`` rows / ``requests`` requests) to the device."""
        if self.device.type != "cuda":
            return  # the host buffers are the device buffers
        for name, region in self._regions(plan, tokens, requests):
            self.dev[name][region].copy_(self.host[name][region], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def pack(self, plan: StepPlan) -> np.ndarray:
        """The plan and its used values as one int64 array (what tensor-parallel followers receive)."""
        parts = [np.asarray(plan.header(), dtype=np.int64)]
        parts.extend(self.np[name][region].reshape(-1).astype(np.int64, copy=False)
                     for name, region in self._regions(plan))
        return np.concatenate(parts)

    def unpack(self, packed: np.ndarray) -> StepPlan:
        """Write a packed plan into these host buffers; returns the plan. Like every writer, it first waits
        for the device to have copied the previous plan (a follower's previous upload may still be reading)."""
        self.writable()
        plan = StepPlan.from_header(packed[:_HEADER_SIZE].tolist())
        offset = _HEADER_SIZE
        for name, region in self._regions(plan):
            view = self.np[name][region]
            view[...] = packed[offset : offset + view.size].reshape(view.shape)
            offset += view.size
        return plan

    @staticmethod
    def _regions(plan: StepPlan, tokens: int | None = None, requests: int | None = None
                 ) -> list[tuple[str, tuple[slice, ...]]]:
        """The part of each buffer a plan uses (padded to ``tokens`` rows and ``requests`` requests when given)."""
        tokens = plan.num_tokens if tokens is None else tokens
        requests = plan.num_requests if requests is None else requests
        rows, per_request = (slice(tokens),), (slice(requests),)
        regions = [("token_ids", rows), ("positions", rows), ("slots", rows), ("seq_lens", per_request),
                   ("query_start", (slice(requests + 1),)), ("lm_rows", (slice(plan.num_sample + plan.num_score + plan.num_verify),)),
                   ("gather_rows", (slice(plan.num_gather),)), ("gather_from", (slice(plan.num_gather),)),
                   ("image_rows", (slice(plan.num_images),)),
                   ("shift_from", (slice(requests if plan.shifted else 0),)),
                   ("block_tables", (slice(requests), slice(plan.block_width)))]
        if plan.mrope:
            regions.append(("mrope_positions", (slice(None), slice(tokens))))
        if plan.lora:
            regions.append(("lora_rows", rows))
        return regions


def prompt_positions_to_score(sequence: "Sequence", count: int) -> range:
    """Positions of this step's chunk whose logits score the next prompt token and are not scored yet.

    Position ``p`` predicts prompt token ``p + 1``; positions scored before a preemption are not
    scored again when the request is recomputed.
    """
    if not sequence.prompt_scores_missing:
        return range(0)
    start = sequence.num_computed
    return range(max(start, sequence.num_scored), min(start + count, sequence.num_prompt - 1))


def write_plan(entries: list[tuple["Sequence", int]], block_size: int, buffers: StepBuffers,
               images: "StepImages | None" = None) -> StepPlan:
    """Write one step into ``buffers``' host side; ``entries`` come decode-shaped (one token) first.

    A row whose token is not known on the host yet (``sequence.pending_row`` is set: the step in
    flight samples it) is listed for the device-side gather instead: the last row, or the row before the
    drafts of a request that drafts past its token in flight. A request whose pending token comes from a
    verify step in flight gets its index there in ``shift_from`` (the runner corrects its rows). ``images``:
    the step's image inputs (vision-language models), which also set the rotary positions.

    Long: one pass over the entries writes every buffer a row touches; split by buffer, each piece would walk
    the entries again, and this loop runs every step for every row.
    """
    buffers.writable()
    out = buffers.np
    token_ids, positions, slots = out["token_ids"], out["positions"], out["slots"]
    seq_lens, query_start, tables = out["seq_lens"], out["query_start"], out["block_tables"]
    lm_rows, gather_rows, gather_from = out["lm_rows"], out["gather_rows"], out["gather_from"]
    shift_from, shifted = out["shift_from"], False
    shift_from[: len(entries)] = -1
    lora_rows, lora = out["lora_rows"], False
    row = num_decode = num_gather = num_sample = 0
    score_rows: list[int] = []
    verify_rows: list[int] = []
    width = 1
    record_routing = False
    query_start[0] = 0
    prefill_tokens = 0
    for index, (sequence, count) in enumerate(entries):
        record_routing = record_routing or sequence.routing is not None
        start = sequence.num_computed
        end = start + count
        known = len(sequence.token_ids)
        table = sequence.block_table
        # where the token the step in flight samples goes: after the known tokens, before this step's drafts
        pending_at = known - sequence.num_drafts if sequence.pending_tokens else end
        if start <= pending_at < end:  # gathered on the device
            gather_rows[num_gather] = row + pending_at - start
            gather_from[num_gather] = sequence.pending_row
            num_gather += 1
            if sequence.verify_row >= 0:  # that token comes from a verify step: the runner corrects these rows
                shift_from[index] = sequence.verify_row
                shifted = True
        if count == 1:  # decode-shaped: plain integers are ~10x cheaper than numpy calls here
            if pending_at != start:
                token_ids[row] = sequence.token_ids[start]
            positions[row] = start
            slots[row] = table[start // block_size] * block_size + start % block_size
        else:
            head = min(end, pending_at) - start  # the rows before the pending token, then the drafts after it
            token_ids[row : row + head] = sequence.token_ids[start : start + head]
            if pending_at < end - 1:
                token_ids[row + head + 1 : row + count] = sequence.token_ids[pending_at : end - 1]
            span = np.arange(start, end)
            positions[row : row + count] = span
            first_block = start // block_size
            block_ids = np.asarray(table[first_block : (end - 1) // block_size + 1], dtype=np.int64)
            slots[row : row + count] = block_ids[span // block_size - first_block] * block_size + span % block_size
        if sequence.lora_slot >= 0 or lora:  # rows before the first adapter row are written once one comes
            if not lora:
                lora_rows[:row] = -1
                lora = True
            lora_rows[row : row + count] = sequence.lora_slot
        if sequence.prompt_scores_missing:
            score_rows.extend(row + p - start for p in prompt_positions_to_score(sequence, count))
        row += count
        if count == sequence.num_uncomputed:  # the chunk reaches its last token: it samples
            lm_rows[num_sample] = row - 1
            num_sample += 1
            verify_rows.extend(range(row - 1 - sequence.num_drafts, row - 1))
        tables[index, : len(table)] = table
        width = max(width, len(table))
        seq_lens[index] = end
        if count == 1 and index == num_decode:
            num_decode += 1
        else:
            prefill_tokens += count
            query_start[index - num_decode + 1] = prefill_tokens
    num_prefill = len(entries) - num_decode
    lm_rows[num_sample : num_sample + len(score_rows)] = score_rows
    lm_rows[num_sample + len(score_rows) : num_sample + len(score_rows) + len(verify_rows)] = verify_rows
    plan = StepPlan(row, num_decode, num_prefill, width, num_sample, len(score_rows), len(verify_rows), num_gather,
                    shifted, record_routing=record_routing, lora=lora)
    if images is not None:
        _write_images(plan, images, buffers)
    return plan


def _write_images(plan: StepPlan, images: "StepImages", buffers: StepBuffers) -> None:
    out = buffers.np
    plan.num_images = len(images.rows)
    out["image_rows"][: plan.num_images] = images.rows
    if images.positions is not None:
        out["positions"][: plan.num_tokens] = images.positions
    if images.mrope_positions is not None:
        plan.mrope = True
        out["mrope_positions"][:, : plan.num_tokens] = np.asarray(images.mrope_positions, dtype=np.int64)
