"""Decode steps with adapter rows replayed from CUDA graphs: one more graph per decode batch size, over padded
slot ids.

A graph fixes the kernels it launches and their shapes, not the values they read. The adapter graphs are
captured with a padded :class:`~megatron_kernels.reference_lora.LoraBatch`: every row reads its slot from the
step buffer ``lora_rows`` on the device (``-1``: the base model, and every padding row), so one graph per batch
size serves any mix of adapters and base rows, any number of active adapters and mixed ranks (slots are
padded to ``--max-lora-rank`` already). Steps without adapter rows keep replaying the base graphs, which never
touch the slots. Not captured (those steps run eagerly): adapters on MoE experts (their hook picks rows on
the host), tensor parallelism above 1 (the other ranks would have to capture the same graphs in lockstep),
and mixed (prefill) steps with adapter rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from megatron_kernels.reference_lora import LoraBatch

from ..precompile.graphs import DecodeGraphs, GraphOutputs

if TYPE_CHECKING:
    from ...model.lora.slots import LoraSlots
    from ..runner import ModelRunner


class LoraDecodeGraphs(DecodeGraphs):
    """Decode graphs whose forward applies the slots' adapters to each row by the slot in ``lora_rows``."""

    def __init__(self, base: DecodeGraphs, slots: "LoraSlots", capture_factory: Callable):
        super().__init__(base.model, base.batch_sizes, base.buffers, capture_factory)
        self.slots = slots

    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], capture=None) -> None:
        try:
            super().capture(kv_caches, capture)
        finally:
            self.slots.rows.batch = None  # the next step sets its own

    def _reset_to_padding(self) -> None:
        super()._reset_to_padding()
        self.buffers.dev["lora_rows"].fill_(-1)

    def _forward_for(self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> Callable[[], GraphOutputs]:
        forward = super()._forward_for(size, kv_caches)
        batch = LoraBatch.of_padded(self.buffers.dev["lora_rows"][:size])
        rows = self.slots.rows

        def with_adapters() -> GraphOutputs:
            rows.batch = batch  # what the hooks read while the graph is captured (a stand-in reads it each replay)
            return forward()

        return with_adapters


def add_lora_graphs(runner: "ModelRunner", slots: "LoraSlots", kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> bool:
    """Give ``runner``'s graphs decode graphs for steps with adapter rows and capture them now (they are captured
    again with the others on resume); False where such steps stay eager (see the module doc)."""
    graphs = runner.graphs
    if graphs is None or runner.model.tp.size > 1 or not slots.graphable:
        return False
    graphs.lora_decode = LoraDecodeGraphs(graphs.decode, slots, graphs.capture_factory)
    graphs.lora_decode.capture(kv_caches)
    return True
