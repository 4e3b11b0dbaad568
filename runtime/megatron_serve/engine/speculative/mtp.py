"""The target's own MTP layer guesses its next tokens (``method: mtp``; DeepSeek-V3 / GLM-4.5 / MiMo style).

The target keeps each forward row's last hidden state before its final norm (``LlamaModel.capture_hidden``,
on only with this method); :meth:`MtpProposer.observe` files them per request and position after every
target forward. The MTP layer (:mod:`megatron_serve.model.mtp`) row for position ``i`` takes the target's
hidden state ``h_i`` and the embedding of token ``i + 1`` and predicts token ``i + 2``; its keys and values
sit in a private paged cache (:class:`.draft_cache.DraftCache`, one layer) keyed by the request's tokens
shifted by one. A call brings that cache up to the last verified position (the rows the last verify step
accepted, as prefill chunks, with the target's exact hidden states), then chains the layer K times: each
guess is fed back with the layer's own output hidden state. The chained rows are dropped from the cache
afterwards (:meth:`DraftCache.truncate`), so the next call recomputes the accepted ones from the target's
hidden states, as vLLM's and SGLang's MTP do.

Refit (RL): the MTP layer is part of the policy's checkpoint, so a refit carries its tensors under their
checkpoint names (``model.layers.{num_hidden_layers}.*``); the engine routes them here (:meth:`owns`,
:meth:`load_weights`) in the policy's transaction. A refit without them leaves the layer stale: it
proposes nothing until one brings them. Hidden states of the old weights are dropped at a refit, so
requests in flight then run without guesses.

Cost: K forwards of one decoder layer per step plus the target's LM head over the drafting rows; the
hidden states a request holds are those not yet in the MTP cache (a few rows after each step). Verify
steps that replay CUDA graphs do not refresh the captured hidden states; guesses then only lose
acceptance, never correctness (the output is always the target's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

from ...config import InferenceConfig
from ...model.llama import LlamaForCausalLM
from ...model.loader import _default_dtype, iterate_checkpoint, load_weights as load_model_weights
from ...model.mtp import MtpLayers
from ...model.tensor_source import TensorSource
from .draft_cache import DraftCache, DraftRows, chain_guesses, guesses_wanted
from .proposer import DraftInput


class MtpCheckpointError(ValueError):
    """The target's checkpoint holds no usable MTP layer (missing tensors, wrong shapes)."""


class MtpProposer:
    """Greedy chained guesses of the target's first MTP layer, from the target's own hidden states."""

    reads_hidden_states = True

    def __init__(self, target: LlamaForCausalLM, target_dir: str | Path, config: InferenceConfig, *,
                 epoch: int = 0, block_size: int = 16, initial_blocks: int = 64):
        self.target = target
        self.device = target.rotary_cos.device
        try:
            with _default_dtype(target.dtype), torch.device(self.device):
                self.mtp = MtpLayers(target.config, self.device).eval()
            load_model_weights(self.mtp, iterate_checkpoint(target_dir))
        except ValueError as exc:
            raise MtpCheckpointError(f"MTP layer of {target_dir}: {exc}") from exc
        target.model.capture_hidden = True
        self.cache = DraftCache(self.mtp, block_size, initial_blocks, self.device, num_layers=1)
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, hidden rows from it)
        self.max_positions = target.config.max_position_embeddings
        self.target_epoch = epoch
        self.mtp_epoch = epoch

    @property
    def stale(self) -> bool:
        """The MTP layer's weights are not the target's epoch: it proposes nothing until refit."""
        return self.mtp_epoch != self.target_epoch

    def owns(self, name: str) -> bool:
        """A refit tensor of the MTP layer (what the engine hands to :meth:`load_weights`)."""
        return self.mtp.owns(name)

    def check_weights(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """``ValueError`` naming the first refit tensor of the MTP layer that does not fit it: its loader run on a
        shape-only (meta) copy, as the policy's verify step does, so a bad MTP tensor refuses the refit before any
        weight changes."""
        with _default_dtype(torch.float32), torch.device("meta"):
            shadow = MtpLayers(self.target.config, torch.device("meta"))
        load_model_weights(shadow, ((name, torch.empty(shape, device="meta")) for name, shape in shapes), partial=True)

    def forget(self, request_id: str) -> None:
        self.cache.drop(request_id)
        self._hidden.pop(request_id, None)

    def on_refit(self, epoch: int) -> None:
        self.cache.drop_all()
        self._hidden.clear()
        self.target_epoch = epoch

    def load_weights(self, named_tensors: Iterable[tuple[str, TensorSource]], epoch: int,
                     partial: bool = False) -> None:
        """Refit the MTP layer to ``epoch`` (checkpoint names); stale until the load succeeds."""
        self.cache.drop_all()
        self.mtp_epoch = -1
        load_model_weights(self.mtp, named_tensors, partial=partial)
        self.mtp_epoch = epoch

    def observe(self, rows: Sequence[tuple[str, int, int]]) -> None:
        """After a target forward whose token rows are ``(request id, first position, count)`` in order: file
        each row's hidden state (rejected drafts' rows too; :meth:`propose` reads verified positions only)."""
        hidden = self.target.model.captured_hidden
        if hidden is None or hidden.shape[0] < sum(count for _, _, count in rows):
            return  # not this forward's (a replayed graph of another size): those positions get no guesses
        offset = 0
        for request_id, start, count in rows:
            new = hidden[offset: offset + count]
            offset += count
            base, held = self._hidden.get(request_id, (start, new[:0]))
            if not base <= start <= base + held.shape[0]:
                base, held = start, new[:0]
            self._hidden[request_id] = (base, torch.cat([held[: start - base], new]))

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in inputs]
        if self.stale:
            return out
        wanted = guesses_wanted(inputs, self.max_positions, lambda item: len(item.token_ids) > 1 and self._ready(
            item.request_id, list(item.token_ids[1:])))
        if not wanted:
            return out
        rows = self.cache.prepare([(inputs[i].request_id, list(inputs[i].token_ids[1:]), wanted[i]) for i in wanted])
        hidden = self._packed_hidden(rows)

        def forward(rows: DraftRows, kept: list[int] | None) -> list[int]:
            nonlocal hidden  # each row's input state: the target's, then the layer's own output for its guess
            if kept is not None:
                hidden = hidden[torch.tensor(kept, dtype=torch.int64, device=self.device)]
            tokens, hidden = self._greedy(rows, hidden)
            return tokens

        chain_guesses(self.cache, rows, wanted, out, forward)
        for index in wanted:  # keep what the target's hidden states computed; drop the chained rows
            request_id, verified = inputs[index].request_id, len(inputs[index].token_ids) - 1
            self.cache.truncate(request_id, verified)
            base, held = self._hidden[request_id]
            self._hidden[request_id] = (verified, held[verified - base:])
        return out

    def _ready(self, request_id: str, shifted: list[int]) -> bool:
        """The target's hidden states of every position the MTP cache lacks are filed (else: no guesses now)."""
        base, held = self._hidden.get(request_id, (0, None))
        if held is None or base + held.shape[0] < len(shifted):
            return False
        cached = self.cache.cached_tokens(request_id)
        keep, limit = 0, min(len(cached), len(shifted) - 1)
        while keep < limit and cached[keep] == shifted[keep]:
            keep += 1
        return keep >= base

    def _packed_hidden(self, rows: DraftRows) -> torch.Tensor:
        """The target's hidden state of each of ``rows``' positions, in their packed order."""
        packed = sorted(range(len(rows.request_ids)), key=rows.request_order.__getitem__)
        parts, first = [], 0
        for row_index, i in enumerate(packed):
            last = rows.last_rows[row_index]
            base, held = self._hidden[rows.request_ids[i]]
            start = rows.positions[first] - base
            parts.append(held[start: start + last + 1 - first])
            first = last + 1
        return torch.cat(parts)

    def _greedy(self, rows: DraftRows, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One MTP forward over ``rows`` (cache writes included): per request in ``rows.request_ids`` order, the
        argmax after its last row and that row's output hidden state."""
        layers = self.cache.layer_caches * (self.mtp.index + 1)  # the layer reads entry ``index``
        token_ids = rows.tensor(rows.token_ids, torch.int64)
        normed, summed = self.mtp.layer.predict(self.target.model.embed_tokens(token_ids), hidden,
                                        rows.tensor(rows.positions, torch.int64), rows.context(layers),
                                        self.mtp.rotary_cos, self.mtp.rotary_sin)
        order = rows.tensor([rows.last_rows[slot] for slot in rows.request_order], torch.int64)
        tokens = self.target.compute_logits(normed[order]).argmax(dim=-1).tolist()
        return tokens, summed[order]
