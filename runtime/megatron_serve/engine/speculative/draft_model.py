"""A smaller model of the same vocabulary guesses the target's next tokens, greedily (``method: draft_model``).

The drafter is the project's own decoder (:func:`~megatron_serve.model.loader.load_model`) in the
engine's dtype and on its device, with a private paged KV cache (:class:`.draft_cache.DraftCache`):
the same attention kernels and block layout as the target's, so nothing here re-implements a
layer. Each request keeps the tokens whose keys and values sit in its blocks. A call sees the
request's full token list, keeps the cached prefix that still matches it (what the target accepted
of the last guesses), and recomputes only the rest: after a verify step that is the accepted
guesses' tail plus the target's own token, one to K+1 rows per request. All requests of a call
share one forward per draft position: the first (the recomputed suffixes, as prefill chunks) and
then K-1 single-row decode forwards of every request still drafting.

Refit (RL): :meth:`on_refit` drops every request's cache and marks the drafter stale until
:meth:`load_weights` brings tensors of the same epoch; a stale drafter proposes nothing, so no guess
under a new epoch comes from old weights (the output would still be the target's: guesses only
cost speed, never correctness).

Cost: K forwards of the drafter per step (the first over the recomputed rows), each building its
attention metadata from Python lists, eagerly (no CUDA graphs); the cache grows by doubling when
full (a copy of the pool), so its memory is what the live requests hold, at most twice that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

from ...config import InferenceConfig
from ...model.config import ModelConfig
from ...model.loader import load_model, load_weights as load_model_weights, verify_shapes
from ...model.tensor_source import TensorSource
from ..sizing import default_dtype
from .draft_cache import DraftCache, DraftRows, chain_guesses, guesses_wanted
from .proposer import DraftInput


class VocabMismatchError(ValueError):
    """The draft model's vocabulary is not the target's: its token ids would mean other words."""


def _tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415 - only when both sides carry a tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_vocab(draft_dir: str | Path, target_dir: str | Path) -> None:
    """Refuse a draft whose embedding size differs from the target's, or whose tokenizer maps any token
    to another id (checked when both directories hold a ``tokenizer.json``)."""
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    draft, target = ModelConfig.from_dir(draft_dir).vocab_size, ModelConfig.from_dir(target_dir).vocab_size
    if draft != target:
        raise VocabMismatchError(f"draft model {draft_dir} has vocab_size {draft} but the target {target_dir} has "
                                 f"{target}: a draft model must share the target's tokenizer")
    draft_vocab, target_vocab = _tokenizer_vocab(draft_dir), _tokenizer_vocab(target_dir)
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise VocabMismatchError(f"draft model {draft_dir} has another tokenizer than the target {target_dir} "
                                 f"(e.g. {differing}): a draft model must share the target's tokenizer")


class DraftModelProposer:
    """Greedy guesses of a smaller model, K per request, from a per-request KV cache kept between steps.

    ``target_dir``: the target's model directory, to refuse a draft of another vocabulary
    (:func:`check_vocab`). ``epoch``: the weights' generation the checkpoint belongs to (the engine
    starts at 0).
    """

    reads_hidden_states = False

    def __init__(self, model_dir: str | Path, config: InferenceConfig, *, target_dir: str | Path | None = None,
                 epoch: int = 0, block_size: int = 16, initial_blocks: int = 64):
        if target_dir is not None:
            check_vocab(model_dir, target_dir)
        model_config = ModelConfig.from_dir(model_dir)
        self.device = torch.device(config.device)
        self.model = load_model(model_dir, default_dtype(config, model_config), self.device)
        self.max_positions = model_config.max_position_embeddings
        self.cache = DraftCache(self.model, block_size, initial_blocks, self.device)
        self.target_epoch = epoch  # the engine's weights' epoch (on_refit)
        self.draft_epoch = epoch  # the drafter's weights' epoch (load_weights)

    @property
    def stale(self) -> bool:
        """The drafter's weights are not the target's epoch: it proposes nothing until refit."""
        return self.draft_epoch != self.target_epoch

    def forget(self, request_id: str) -> None:
        self.cache.drop(request_id)

    def observe(self, rows: Sequence[tuple[str, int, int]]) -> None:
        pass  # guesses from tokens alone: the target's hidden states are not needed

    def on_refit(self, epoch: int) -> None:
        self.cache.drop_all()
        self.target_epoch = epoch

    def check_weights(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """``ValueError`` naming the first refit tensor (Hugging Face name) that does not fit the draft model."""
        verify_shapes(self.model, shapes, partial=True)

    def load_weights(self, named_tensors: Iterable[tuple[str, TensorSource]], epoch: int,
                     partial: bool = False) -> None:
        """Refit the drafter's weights to ``epoch`` (Hugging Face names, as its checkpoint's); every cached
        key and value is dropped. Before or after the engine's :meth:`on_refit` of the same epoch: the
        drafter proposes again once both have happened."""
        self.cache.drop_all()
        self.draft_epoch = -1  # a load that fails midway leaves mixed weights: stale until a load succeeds
        load_model_weights(self.model, named_tensors, partial=partial)
        self.draft_epoch = epoch

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in inputs]
        if self.stale:
            return out
        wanted = guesses_wanted(inputs, self.max_positions, lambda item: len(item.token_ids) > 0)
        if not wanted:
            return out
        rows = self.cache.prepare([(inputs[i].request_id, list(inputs[i].token_ids), wanted[i]) for i in wanted])
        chain_guesses(self.cache, rows, wanted, out, lambda rows, _kept: self._greedy(rows))
        return out

    def _greedy(self, rows: DraftRows) -> list[int]:
        """One forward over ``rows`` (cache writes included): the argmax after each request's last row."""
        context = rows.context(self.cache.layer_caches)
        hidden = self.model(rows.tensor(rows.token_ids, torch.int64), rows.tensor(rows.positions, torch.int64),
                            context)
        logits = self.model.compute_logits(hidden[rows.tensor(rows.last_rows, torch.int64)])
        tokens = logits.argmax(dim=-1).tolist()
        return [tokens[slot] for slot in rows.request_order]
