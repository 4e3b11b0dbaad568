"""Per-request sampling state in persistent device buffers: written once when a request starts sampling.

vLLM v1's ``InputBatch`` at this engine's size. Each request that samples holds a slot: its
sampler inputs (one device vector per ``sampler`` of the table of sampling parameters,
``wire/sampling_fields.py``: temperature, top-k, top-p, min-p, penalties, min_tokens) and its seed key sit in
device vectors indexed by slot; a request with logit controls (bias, min_tokens, penalties) also holds a row of four dense
``[rows, vocab]`` tables (additive bias, stop tokens held back by min_tokens, output token counts,
prompt tokens). A slot is bound the first time a request samples and freed when it leaves the engine
or is preempted (the next binding rebuilds it from the tokens on the host), so at most about
``max_requests`` slots are live. The output token counts are then kept on the device: the sampler adds
each sampled token to its row's counts there, so a penalised request needs no token on the host and
runs every step under overlapped scheduling.

A step then only writes, per sampling row, four integers (slot, control row, position, tokens generated
so far) into a pinned host buffer and copies them without blocking, as ``step_plan`` does with the
step's inputs: steady-state steps build no tensor from Python data.

Seeds: a request's draws are keyed on (seed, sample index, position) by a counter-based hash
(:func:`fmix32`, murmur3's finalizer), so sample ``i`` of ``n`` draws its own reproducible stream,
independent of the batch, of preemption and of the engine; an unseeded request gets a seed drawn when
it is added to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

import numpy as np
import torch

from ...wire.sampling_fields import FILTER, PENALTIES, SAMPLER_INPUTS
from ...wire.sampling_params import SamplingParams

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9

#: The float vectors and the integer vectors per slot, by name (their row in ``floats`` / ``ints``): the table's
#: sampler inputs, then the seed's key and whether the slot decodes greedily.
_FLOATS = tuple(row.sampler for row in SAMPLER_INPUTS if row.kind is float)
_INTS = tuple(row.sampler for row in SAMPLER_INPUTS if row.kind is int) + ("seed_key", "greedy")
_PENALTY_INPUTS = frozenset(row.sampler for row in PENALTIES)
_SAMPLER_NAMES = frozenset(row.sampler for row in SAMPLER_INPUTS)
#: The per-row integers a step writes: slot, control row, position of the token drawn, tokens generated so far.
_ROW_FIELDS = 4


def fmix32(x):  # type: ignore[no-untyped-def] - a Python int or an int64 tensor holding 32-bit values
    """Murmur3's 32-bit finalizer: every output bit depends on every input bit.

    On int64 tensors the products overflow and wrap; masking keeps their low 32 bits, which are exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int, sample_index: int) -> int:
    """The 32-bit key of a request's stream, from its 63-bit seed and its index among ``n`` samples."""
    return fmix32((seed & MASK32) ^ fmix32(((seed >> 32) & MASK32) ^ fmix32((sample_index * _GOLDEN) & MASK32)))


@dataclass
class SlotInfo:
    """What the host keeps of a slot: enough to decide which ops a step needs, without reading the device."""

    greedy: bool
    top_k: int
    control: int  # row in the control tables; 0: the neutral row (no controls)
    top_n: int  # top log probs asked for
    log_probs: bool  # log probs asked for (or top_n)
    inputs: frozenset[str]  # the sampler inputs off their neutral value (filters: only when it samples)
    kept_ids: bool = False  # return_top_p_token_ids: the ids its filters keep at each step


_NEUTRAL = SlotInfo(True, 0, 0, 0, False, frozenset())


@dataclass
class StepRows:
    """One step's sampling rows: device views of their slots and counters, and what the step needs."""

    slot: torch.Tensor  # [rows] int64
    control: torch.Tensor  # [rows] int64
    position: torch.Tensor  # [rows] int64: position of the token drawn (keys the seeded stream)
    generated: torch.Tensor  # [rows] int64: tokens generated before this one (min_tokens)
    infos: list[SlotInfo]

    def __post_init__(self) -> None:
        infos = self.infos
        self.any_sampled = not all(i.greedy for i in infos)
        self.all_sampled = not any(i.greedy for i in infos)
        self.inputs: frozenset[str] = frozenset().union(*(i.inputs for i in infos))  # used by some row
        self.max_top_k = max((i.top_k for i in infos if not i.greedy), default=0)
        self.any_controls = any(i.control for i in infos)
        self.any_penalties = not self.inputs.isdisjoint(_PENALTY_INPUTS)
        self.wanted = [row for row, i in enumerate(infos) if i.log_probs]
        self.kept = [row for row, i in enumerate(infos) if i.kept_ids]  # rows that want their kept ids
        self.top_n = max((i.top_n for i in infos), default=0)

    def uses(self, sampler_input: str) -> bool:
        """Whether some row of the step sets the table's ``sampler`` input away from its neutral default: an op skips
        its work otherwise. One question for every input, so that a new row needs no flag of its own here."""
        if sampler_input not in _SAMPLER_NAMES:
            raise KeyError(f"no sampler input {sampler_input!r} in the sampling table")
        return sampler_input in self.inputs

    def __len__(self) -> int:
        return len(self.infos)

    def shift(self, shift: torch.Tensor) -> None:
        """Move each row back by ``shift`` (int64, on the device): the rows of a step planned before the verify
        step ahead of it was read draw at the positions, and after the tokens, that step really reached."""
        self.position = self.position - shift
        self.generated = self.generated - shift


class SamplingState:
    """The slots of the requests that sample on one engine, on ``device``, for a ``vocab_size`` vocabulary."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8):
        self.vocab_size, self.device = vocab_size, device
        self.floats = torch.zeros((len(_FLOATS), capacity + 1), dtype=torch.float32, device=device)
        self.ints = torch.zeros((len(_INTS), capacity + 1), dtype=torch.int64, device=device)
        self.bias = torch.zeros((1, vocab_size), dtype=torch.float32, device=device)
        self.stop_mask = torch.zeros((1, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((1, vocab_size), dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros((1, vocab_size), dtype=torch.bool, device=device)
        self.token_keys = fmix32((torch.arange(vocab_size, dtype=torch.int64, device=device) * _GOLDEN) & MASK32)
        self._slots: dict[str, int] = {}
        self._infos: list[SlotInfo | None] = [_NEUTRAL] + [None] * capacity
        self._free_slots = list(range(capacity, 0, -1))  # slot 0: the neutral greedy slot of rows being dropped
        for row in SAMPLER_INPUTS:  # slot 0 holds every input's neutral value
            self.vector(row.sampler)[0] = row.default  # type: ignore[arg-type] - sampler inputs have a name
        self.ints[_INTS.index("greedy"), 0] = 1
        self._free_controls: list[int] = []  # rows of the control tables; row 0 is never handed out
        self._rows = _RowBuffers(capacity + 1, device)

    def __contains__(self, key: str) -> bool:
        return key in self._slots

    def vector(self, name: str) -> torch.Tensor:
        """One per-slot vector (a row of ``floats`` or ``ints``) by name."""
        return self.floats[_FLOATS.index(name)] if name in _FLOATS else self.ints[_INTS.index(name)]

    # ------------------------------------------------------------------ binding
    def add(self, key: str, params: SamplingParams, seed: int, prompt_tokens: Seq[int], output_tokens: Seq[int],
            stop_token_ids: Iterable[int]) -> None:
        """Bind a slot to request ``key`` and write its parameters (and control rows) to the device."""
        if not self._free_slots:
            self._grow_slots()
        slot = self._free_slots.pop()
        control = self._bind_controls(params, prompt_tokens, output_tokens, stop_token_ids)
        greedy = params.is_greedy
        values = {row.sampler: getattr(params, row.name) for row in SAMPLER_INPUTS}
        if greedy:
            values["temperature"] = 1.0  # a greedy row's logits are not scaled (its filters do not apply)
        inputs = frozenset(row.sampler for row in SAMPLER_INPUTS
                           if values[row.sampler] != row.default and not (greedy and row.stage == FILTER))
        info = SlotInfo(greedy, params.top_k, control, params.top_n_logprobs,
                        params.return_log_probs or bool(params.top_n_logprobs), inputs, params.return_top_p_token_ids)
        values["top_k"] = min(params.top_k, self.vocab_size)
        floats = [values[name] for name in _FLOATS]
        ints = [values[name] for name in _INTS[:-2]] + [seed_key(seed, params.sample_index), int(greedy)]
        self.floats[:, slot] = self._stage(torch.tensor(floats, dtype=torch.float32))
        self.ints[:, slot] = self._stage(torch.tensor(ints, dtype=torch.int64))
        self._slots[key] = slot
        self._infos[slot] = info

    def remove(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        info = self._infos[slot]
        if info is not None and info.control:
            self._free_controls.append(info.control)
        self._infos[slot] = None
        self._free_slots.append(slot)

    def clear(self) -> None:
        for key in list(self._slots):
            self.remove(key)

    def _stage(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` on the device without waiting for queued work: pinned and copied asynchronously (torch's
        pinned allocator keeps the source until the copy has run)."""
        if self.device.type != "cuda":
            return values
        return values.pin_memory().to(self.device, non_blocking=True)

    def _bind_controls(self, params: SamplingParams, prompt_tokens: Seq[int], output_tokens: Seq[int],
                       stop_token_ids: Iterable[int]) -> int:
        if not params.has_logits_controls:
            return 0
        if not self._free_controls:
            self._grow_controls()
        row = self._free_controls.pop()
        vocab = self.vocab_size
        bias = torch.zeros(vocab, dtype=torch.float32)
        for token, value in (params.logit_bias or {}).items():
            bias[token] += value
        if params.allowed_token_ids is not None:  # every other token is masked out
            bias.masked_fill_(_token_counts(params.allowed_token_ids, vocab) == 0, float("-inf"))
        stop = _token_counts(stop_token_ids, vocab) > 0
        counts = _token_counts(output_tokens, vocab).to(torch.float32)
        prompt = _token_counts(prompt_tokens, vocab) > 0
        for table, values in ((self.bias, bias), (self.stop_mask, stop), (self.counts, counts),
                              (self.prompt_mask, prompt)):
            table[row] = self._stage(values)
        return row

    def _grow_slots(self) -> None:
        old = self.floats.shape[1]
        self.floats = torch.cat([self.floats, torch.zeros_like(self.floats)], dim=1)
        self.ints = torch.cat([self.ints, torch.zeros_like(self.ints)], dim=1)
        self._infos.extend([None] * old)
        self._free_slots = list(range(2 * old - 1, old - 1, -1))

    def _grow_controls(self) -> None:
        old = self.bias.shape[0]
        for name in ("bias", "stop_mask", "counts", "prompt_mask"):
            table = getattr(self, name)
            setattr(self, name, torch.cat([table, torch.zeros_like(table)]))
        self._free_controls = list(range(2 * old - 1, old - 1, -1))

    # ------------------------------------------------------------------- a step
    def rows(self, keys: Seq[str], positions: Seq[int], generated: Seq[int]) -> StepRows:
        """The step's sampling rows, written into the pinned row buffer and uploaded. A key not bound (a request
        that left while its row was in flight: the row is dropped) reads the neutral greedy slot."""
        count = len(keys)
        slots = [self._slots.get(key, 0) for key in keys]
        infos: list[SlotInfo] = [self._infos[slot] for slot in slots]  # type: ignore[misc] - bound slots
        host, device = self._rows.next(count)
        host[0, :count] = slots
        host[1, :count] = [info.control for info in infos]
        host[2, :count] = positions
        host[3, :count] = generated
        self._rows.upload()
        return StepRows(device[0, :count], device[1, :count], device[2, :count], device[3, :count], infos)

    def add_counts(self, rows: StepRows, tokens: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Count each row's sampled token in its control row, on the device (the penalties' view of its output);
        ``weights`` (float32, 1 or 0 per row): count only some rows.

        Rows without controls add to row 0, which only rows with neutral penalties read: their counts
        are multiplied by zero there.
        """
        if rows.any_penalties:  # index_add_ on the flat table: atomics on a GPU, no sort, no synchronization
            self.counts.view(-1).index_add_(0, rows.control * self.vocab_size + tokens,
                                            torch.ones_like(tokens, dtype=torch.float32) if weights is None else weights)


def _token_counts(tokens: Iterable[int], vocab: int) -> torch.Tensor:
    """How often each id below ``vocab`` occurs in ``tokens``: ``[vocab]`` int64 on the host."""
    return torch.bincount(torch.tensor([t for t in tokens if t < vocab], dtype=torch.int64), minlength=vocab)


class _RowBuffers:
    """Two pinned host buffers of per-row integers, used in turn, and their device copies.

    A step writes one while the device may still be copying the other (the previous step's); before
    writing one the host waits for its last copy, which was queued two steps ago. Off CUDA the host
    buffer is the device buffer.
    """

    def __init__(self, capacity: int, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._host = [torch.zeros((_ROW_FIELDS, capacity), dtype=torch.int64, pin_memory=self._cuda)
                      for _ in range(2)]
        self._np = [h.numpy() for h in self._host]
        self._dev = ([torch.zeros((_ROW_FIELDS, capacity), dtype=torch.int64, device=self.device) for _ in range(2)]
                     if self._cuda else self._host)
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def next(self, count: int) -> tuple[np.ndarray, torch.Tensor]:
        """The host buffer to write this step's rows into (as numpy) and its device twin."""
        if count > self._host[0].shape[1]:
            for event in self._copied:
                if event is not None:
                    event.synchronize()
            self._allocate(max(count, 2 * self._host[0].shape[1]))
        self._turn ^= 1
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()
            self._copied[self._turn] = None
        return self._np[self._turn], self._dev[self._turn]

    def upload(self) -> None:
        if not self._cuda:
            return
        turn = self._turn  # the whole buffer (a few KB): a strided slice would be staged through pageable memory
        self._dev[turn].copy_(self._host[turn], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event
