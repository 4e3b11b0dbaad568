"""Choosing the next token of each request from its logits, and the log probs users asked for.

Each request draws from its own stream keyed on (seed, sample index, position) (see
``sampling_state``), so its samples do not depend on which other requests share the batch, on
preemption, or on the engine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...wire.sampling_fields import SUBSET_FILTERS
from ...wire.sampling_params import LOGPROBS_MODES, SamplingParams
from .filters import FilterRows, filtered_logits, lone_rows
from .sampling_state import MASK32, SamplingState, StepRows, fmix32

_SUBSET_FILTERS = frozenset(row.sampler for row in SUBSET_FILTERS)  # a row that sets none reports no kept ids


@dataclass
class SampleResult:
    """A step's sampled tokens and, for the rows that asked, their log probs and top-n (as the wire carries them:
    ``top_ids[row]`` and ``top_log_probs[row]``, best first)."""

    token_ids: list[int]
    log_probs: list[float | None]
    top_ids: list[list[int] | None]
    top_log_probs: list[list[float] | None]
    # return_top_p_token_ids: the ids the row's filters kept, most likely first (a greedy row: its token alone; a row
    # without a filter, or that did not ask: None)
    kept_ids: list[list[int] | None]


@dataclass
class TokenScores:
    """Log probs of given tokens, and the ``top_n`` most likely tokens at each row (best first); ``ranks``: each
    given token's rank in its row (1 = the most likely), when asked for."""

    log_probs: list[float]
    top_ids: list[list[int]]
    top_log_probs: list[list[float]]
    ranks: list[int] | None = None


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
    ranked: bool = False

    def read(self) -> TokenScores:
        values = self.readback.wait()
        ranks = values.pop() if self.ranked else None
        return TokenScores(values[0], *(values[1:] if self.top_n else ([], [])), ranks)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, top_n: int, log_softmax: bool = True,
                 ranked: bool = False) -> DeviceScores:
    """Log-softmax of each row of ``logits`` (or the values themselves), read at ``targets`` (one token per
    row) and at its top ``top_n``; ``ranked``: each target's rank too (how many tokens are at least as likely,
    itself counted: vLLM's rank, which a prompt token outside the top ``top_n`` has as well)."""
    log_probs = torch.log_softmax(logits, dim=-1) if log_softmax else logits
    chosen = log_probs.gather(1, targets[:, None]).squeeze(1)
    ranks = [(log_probs >= chosen[:, None]).sum(dim=-1)] if ranked else []
    if not top_n:
        return DeviceScores(Readback([chosen, *ranks]), 0, ranked)
    values, ids = torch.topk(log_probs, min(top_n, log_probs.shape[-1]))
    return DeviceScores(Readback([chosen, ids, values, *ranks]), top_n, ranked)


@dataclass
class DeviceKeptIds:
    """The kept ids of a step's ``filtered`` rows on their way to the host: each row's vocabulary in its processed
    logits' order (best first, ties by id) and how many of them are finite; ``greedy`` rows keep their token."""

    readback: Readback
    filtered: list[int]
    greedy: list[int]

    def read(self, token_ids: list[int]) -> list[list[int] | None]:
        kept: list[list[int] | None] = [None] * len(token_ids)
        for row in self.greedy:
            kept[row] = [token_ids[row]]
        if self.filtered:
            order, counts = self.readback.wait()
            for row, ids, count in zip(self.filtered, order, counts):
                kept[row] = ids[:count]
        return kept


@dataclass
class DeviceSample:
    """A step's sampled tokens on the device (the next step reads them there) and their way to the host."""

    tokens: torch.Tensor  # [rows] int64
    readback: Readback
    scores: DeviceScores | None  # log probs of every row (when some row asked), read for ``wanted`` rows
    wanted: list[int]
    top_n: list[int]  # per row, how many top log probs it asked for
    kept: DeviceKeptIds | None = None  # when some row asked for its kept ids

    def read(self) -> SampleResult:
        token_ids = self.readback.wait()[0]
        log_probs: list[float | None] = [None] * len(token_ids)
        top_ids: list[list[int] | None] = [None] * len(token_ids)
        top_log_probs: list[list[float] | None] = [None] * len(token_ids)
        if self.scores is not None:
            scores = self.scores.read()
            for row in self.wanted:
                log_probs[row] = scores.log_probs[row]
                n = self.top_n[row]
                if n:
                    top_ids[row], top_log_probs[row] = scores.top_ids[row][:n], scores.top_log_probs[row][:n]
        kept = self.kept.read(token_ids) if self.kept is not None else [None] * len(token_ids)
        return SampleResult(token_ids, log_probs, top_ids, top_log_probs, kept)


#: int64 elements of the noise's hash computed at a time on a CPU (whole rows, at least one): the chunk's scratch
#: stays in a core's cache between the hash's dozen passes, where the whole batch's went out to memory at each.
_CHUNK = 1 << 15


def gumbel_argmax(state: SamplingState, rows: StepRows, scores: torch.Tensor,
                  usable: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's ``argmax(scores + g)`` for Gumbel noise ``g`` (``[rows]`` int64): a draw from
    ``softmax(scores)``, each row's noise a function of its (seed key, position) alone.

    A counter-based hash (``fmix32`` of the row's key and the token's key) gives 24 random bits per
    token: a uniform ``u`` in (0, 1), then ``-log(-log u)``. No generator object, no per-row op: the
    whole batch is a handful of elementwise device ops, and a row's draws do not depend on its batch.
    Rows where ``usable`` is False take no noise (their scores' argmax). On a CPU the rows go in chunks of
    about :data:`_CHUNK` values through scratch tensors reused from chunk to chunk; every value is computed by
    the same ops as in one pass over the batch, so the draws are the same, bit for bit.
    """
    count, vocab = scores.shape
    keys = fmix32(state.vector("seed_key")[rows.slot] ^ fmix32((rows.position * 0x9E3779B9) & MASK32))
    step = count if scores.device.type == "cuda" else max(1, min(count, _CHUNK // max(vocab, 1)))
    bits = torch.empty((step, vocab), dtype=torch.int64, device=scores.device)
    scratch, noise = torch.empty_like(bits), torch.empty((step, vocab), dtype=torch.float32, device=scores.device)
    tokens = torch.empty(count, dtype=torch.int64, device=scores.device)
    for start in range(0, count, step):
        end = min(count, start + step)
        chunk_bits, chunk_noise = bits[: end - start], noise[: end - start]
        torch.bitwise_xor(keys[start:end, None], state.token_keys[None, :vocab], out=chunk_bits)
        _fmix32_(chunk_bits, scratch[: end - start]).bitwise_right_shift_(8)
        chunk_noise.copy_(chunk_bits).add_(0.5).mul_(1.0 / (1 << 24)).log_().neg_().log_().neg_()
        if usable is not None:
            chunk_noise.masked_fill_(~usable[start:end, None], 0.0)
        torch.argmax(chunk_noise.add_(scores[start:end]), dim=-1, out=tokens[start:end])
    return tokens


def _fmix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`fmix32` of an int64 tensor in place, its shifts written into ``scratch`` (same shape): the same
    values without a new tensor per op."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch)).mul_(0x85EBCA6B).bitwise_and_(MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 13, out=scratch)).mul_(0xC2B2AE35).bitwise_and_(MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


class Sampler:
    """Samples a whole batch with a handful of device ops and one read-back of the results.

    Every per-row parameter is read on the device from the :class:`SamplingState` slots: a step
    builds no tensor from Python data, so on a GPU nothing waits for the forward already queued.
    """

    def __init__(self, state: SamplingState, logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.state = state
        self.logprobs_mode = logprobs_mode

    def launch(self, logits: torch.Tensor, rows: StepRows, model_logits: torch.Tensor | None = None,
               count: bool = True) -> DeviceSample:
        """Sample every row on the device and start copying the results to the host (nothing waits).

        ``logits`` ``[rows, vocab]`` float32, after logit controls and grammar masks; ``model_logits``: the
        model's own logits when those changed them (raw log probs are reported from them, as vLLM does
        by default). Penalised rows' token counts are updated on the device with the tokens drawn (``count``:
        False where the caller counts only some rows, as a verify step does).
        """
        processed = logits
        if not rows.any_sampled:
            tokens = torch.argmax(logits, dim=-1)
        else:
            state = self.state
            # only the filters some row uses run: at temperature 1 and no filter (every sampled row of an RL
            # rollout) the logits are used as they are
            processed = filtered_logits(logits, FilterRows(lambda name: state.vector(name)[rows.slot], rows.inputs,
                                                           rows.max_top_k))
            if rows.all_sampled and processed is logits:
                # Every row draws from the logits as they are. A row with no finite maximum (NaN or infinite
                # logits) would take its logits' argmax without noise below; finite noise added to it moves no
                # NaN or infinity, and argmax takes the first of them either way: the same token, one pass less.
                tokens = gumbel_argmax(state, rows, processed)
            else:
                # A greedy row, and a row whose filters leave no finite distribution, take its logits' argmax.
                usable = torch.isfinite(processed.amax(-1))
                if not rows.all_sampled:
                    usable &= state.vector("greedy")[rows.slot] == 0
                if processed is not logits:  # else every row's choice would be the logits themselves
                    processed = torch.where(usable[:, None], processed, logits)
                tokens = gumbel_argmax(state, rows, processed, usable)
        if count:
            self.state.add_counts(rows, tokens)
        kept = self._kept_ids(processed, rows) if rows.kept else None
        scores = None
        if rows.wanted:
            reported = self._reported(logits if model_logits is None else model_logits, processed)
            if kept is not None and kept.filtered and reported is not processed:
                # SGLang's top-p patch reports a filtered row's log probs renormalized over the ids it kept
                renormalized = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
                renormalized[kept.filtered] = True
                reported = torch.where(renormalized[:, None], processed, reported)
            scores = score_tokens(reported, tokens, rows.top_n, log_softmax=self.logprobs_mode.endswith("logprobs"))
        return DeviceSample(tokens, Readback([tokens]), scores, rows.wanted, [i.top_n for i in rows.infos], kept)

    @staticmethod
    def _kept_ids(processed: torch.Tensor, rows: StepRows) -> DeviceKeptIds:
        """The rows that asked for their kept ids: a greedy row keeps its token, a row with a subset filter the
        finite entries of its processed logits (what its draw chose among), sorted on the device; the host reads
        them with the tokens."""
        infos = rows.infos
        greedy = [row for row in rows.kept if infos[row].greedy]
        filtered = [row for row in rows.kept
                    if not infos[row].greedy and not infos[row].inputs.isdisjoint(_SUBSET_FILTERS)]
        if not filtered:
            return DeviceKeptIds(Readback([]), [], greedy)
        values, order = processed[filtered].sort(dim=-1, descending=True, stable=True)
        return DeviceKeptIds(Readback([order.to(torch.int32), torch.isfinite(values).sum(-1)]), filtered, greedy)

    @staticmethod
    def processed_alone(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Rows of model ``logits`` ``[rows, vocab]`` float32 as :meth:`launch` processes a row sampled with
        ``params`` that has no logit controls or grammar: through the filters it uses (a greedy row: the logits).
        The same ops on the same values as in a step (a row's processing depends on that row alone), so what a
        processed mode reports for it, bit for bit."""
        if params.is_greedy:
            return logits
        processed = filtered_logits(logits, lone_rows(params, logits.shape[0], logits.device))
        return torch.where(torch.isfinite(processed.amax(-1))[:, None], processed, logits)

    def _reported(self, model_logits: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
        return processed if self.logprobs_mode.startswith("processed") else model_logits

