"""The engine: one model replica, its paged KV cache, and the step loop over requests.

One module per job (see ``docs/architecture.md``): ``core`` (the step loop), ``scheduler`` (the bookkeeping),
``sequence`` (a request inside), ``worker`` (the device half), ``memory_verbs`` and ``lora_verbs`` (the verbs'
objects), ``verbs`` (what each lifecycle verb does: ``engine.call``), ``expert_api`` (Megatron's expert API: the
public request in and out), ``step_plan``, ``runner``, ``graphs``, ``sampler``, ``logits_processors``,
``structured_output``, ``encoder_cache``, ``sizing``, and the wings ``kv`` (the KV cache), ``group`` (the ranks of
a tensor-parallel group) and ``process`` (the engine process, a shell around the engine). Everything here needs
torch; modules outside the engine that only need a helper (token texts, grammar checks, stats names) import
torch-free modules.
"""

from .core import DynamicInferenceEngine, StepOutput

__all__ = ["DynamicInferenceEngine", "StepOutput"]
