"""An EAGLE-3 head guesses the target's next tokens (``method: eagle3``, ``model``: the head's directory).

The bookkeeping is the MTP proposer's (:class:`.mtp.MtpProposer`): the target files, per request and
position, what the head reads (here the inputs of three of its layers, concatenated:
``LlamaModel.aux_layers``), the head's keys and values sit in a private one-layer paged cache keyed by the
tokens shifted by one, accepted rows are recomputed from the target's states, chained rows are dropped.
Only the step differs (:class:`megatron_serve.model.eagle3.Eagle3Head`): a row carrying the target's states
is first fused by ``fc``; a chained row carries the head's own output. Logits are over the draft
vocabulary; the argmax is mapped to a target id through ``d2t``.

Refit (RL): the head is not part of the policy's checkpoint: a trainer sends its tensors in the policy's
REFIT as ``drafter.`` + the head's checkpoint names (``WeightSender.send(..., drafter=...)``), and the head
loads them in place under the same epoch (:meth:`Eagle3Proposer.load_weights`). A refit of the policy alone
leaves it stale (its ``fc`` was trained on the old policy's hidden states): it proposes nothing under the new
epoch until a refit brings its tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from ...config import InferenceConfig
from ...model.eagle3 import Eagle3Head
from ...model.llama import LlamaForCausalLM
from ...model.tensor_source import TensorSource
from .draft_cache import DraftCache, DraftRows
from .mtp import MtpProposer


class Eagle3Proposer(MtpProposer):
    """Greedy chained guesses of an EAGLE-3 head, from the target's fused hidden states."""

    def __init__(self, target: LlamaForCausalLM, head_dir: str | Path, config: InferenceConfig, *,
                 epoch: int = 0, block_size: int = 16, initial_blocks: int = 64):
        self.target = target
        self.device = target.rotary_cos.device
        self.head = Eagle3Head(head_dir, target.config, target.dtype, self.device)
        target.model.aux_layers = self.head.aux_layers
        target.model.capture_hidden = True
        self.cache = DraftCache(self.head, block_size, initial_blocks, self.device, num_layers=1)
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}
        self.max_positions = target.config.max_position_embeddings
        self.target_epoch = epoch
        self.mtp_epoch = epoch  # the head's epoch (name shared with the MTP bookkeeping)

    def owns(self, name: str) -> bool:
        """No policy tensor is the head's: its own come as ``drafter.*`` (see the module docstring)."""
        return False

    def check_weights(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """``ValueError`` naming the first refit tensor (checkpoint name) that does not fit the head."""
        self.head.check(shapes)

    def load_weights(self, named_tensors: Iterable[tuple[str, TensorSource]], epoch: int,
                     partial: bool = False) -> None:
        """Refit the head to ``epoch`` (its checkpoint's names); stale until the load succeeds."""
        self.cache.drop_all()
        self.mtp_epoch = -1
        self.head.load(named_tensors, partial)
        self.mtp_epoch = epoch

    def _greedy(self, rows: DraftRows, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One head forward over ``rows``: per request in ``rows.request_ids`` order, the target id of the argmax
        after its last row and that row's output hidden state."""
        if hidden.shape[-1] != self.target.config.hidden_size:
            hidden = self.head.fuse(hidden)  # the target's three layers' states: first rows of this call
        token_ids = rows.tensor(rows.token_ids, torch.int64)
        logits, out = self.head.step(self.target.model.embed_tokens(token_ids), hidden,
                                     rows.tensor(rows.positions, torch.int64), rows.context(self.cache.layer_caches))
        order = rows.tensor([rows.last_rows[slot] for slot in rows.request_order], torch.int64)
        tokens = self.head.draft_to_target[logits[order].argmax(dim=-1)].tolist()
        return tokens, out[order]
