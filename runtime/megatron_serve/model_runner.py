"""Turns a scheduled batch into model inputs, runs the forward pass, and returns logits to sample.

Only rows that sample this step (decode tokens and prefill chunks that reach the end of their
sequence) go through the LM head: the rest of a prompt needs its keys and values, not logits.
"""

from __future__ import annotations

import torch

from .model.attention import AttentionMetadata, ForwardContext
from .model.llama import LlamaForCausalLM
from .scheduler import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, sequences: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in sequences)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in sequences]
        return self._tensor(rows, torch.int32)

    def prepare(self, entries: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode = [s for s, count in entries if count == 1]
        prefill = [(s, count) for s, count in entries if count != 1]
        query_start = [0]
        for sequence, count in entries:
            start = sequence.num_computed
            token_ids.extend(sequence.token_ids[start : start + count])
            table, size = sequence.block_table, self.block_size
            for position in range(start, start + count):
                positions.append(position)
                slots.append(table[position // size] * size + position % size)
            if start + count == len(sequence.token_ids):
                sample_rows.append(len(token_ids) - 1)
            if count != 1:
                query_start.append(query_start[-1] + count)
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=len(decode),
            decode_block_tables=self._block_tables(decode) if decode else None,
            decode_context_lens=self._tensor([s.num_computed + 1 for s in decode], torch.int32) if decode else None,
            prefill_block_tables=self._block_tables([s for s, _ in prefill]) if prefill else None,
            prefill_query_start_loc=self._tensor(query_start, torch.int32) if prefill else None,
            prefill_context_lens=self._tensor([s.num_computed + c for s, c in prefill], torch.int32) if prefill else None,
        )
        return self._tensor(token_ids, torch.int64), self._tensor(positions, torch.int64), metadata, sample_rows

    @torch.inference_mode()
    def execute(self, entries: list[tuple[Sequence, int]], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        """Run one step; returns float32 logits ``[sampling rows, vocab]`` in entry order."""
        token_ids, positions, metadata, sample_rows = self.prepare(entries)
        hidden = self.model(token_ids, positions, ForwardContext(metadata, kv_caches))
        return self.model.compute_logits(hidden[self._tensor(sample_rows, torch.int64)])
