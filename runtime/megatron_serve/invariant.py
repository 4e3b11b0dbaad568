"""Trainer side of ``--batch-invariant`` under the server's name: :mod:`megatron_kernels.invariant_trainer`.

The op set lives in the kernels package so that a trainer can install it without the server
(``pip install megatron-serve-invariant``: ``torch`` and ``transformers`` only) and import it as
``megatron_kernels.invariant_trainer``; with ``megatron-serve`` installed, this module gives the same
names (docs/batch-invariance.md). Importing either registers ``megatron_invariant`` with ``transformers``.
"""

from megatron_kernels.invariant_trainer import (
    ATTENTION_NAME,
    batch_invariant,
    hf_attention,
    replay_routing,
    use_invariant_lora,
    use_invariant_norms,
)

__all__ = ["ATTENTION_NAME", "batch_invariant", "hf_attention", "replay_routing", "use_invariant_lora",
           "use_invariant_norms"]
