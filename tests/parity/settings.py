"""The engine against itself: pairs of setups that must not change a token, one row per execution path.

Each row runs the same case (same requests, same arrival steps) under setup A and setup B and
compares every request token by token (``compare.between_runs``). A new execution path of the
engine (a config knob, a step-loop variant) joins the search as one row here, in the change that
adds it. ``share`` is how often the row comes up relative to the others: rows that start processes
or run the Triton interpreter on CPU cost seconds per case and come up less.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .engine_runs import ALTERNATIVE, SELF, Setup
from .models import ModelSpec


def _any_model(spec: ModelSpec) -> bool:
    return True


def _text_model(spec: ModelSpec) -> bool:
    return not spec.vision


# K pinned (no adaptive policy): every step that can speculate does, so the rows exercise the verify path
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
DRAFT_SELF = {"method": "draft_model", "model": SELF, "num_speculative_tokens": 3,  # accepts (nearly) every guess
              "adaptive": False}


@dataclass(frozen=True)
class Setting:
    a: Setup
    b: Setup
    share: int = 8
    applies: Callable[[ModelSpec], bool] = _any_model  # a model it cannot run gets the next row instead


SETTINGS: dict[str, Setting] = {
    # On CPU, graphs are the stand-in capture of tests/graph_replay.py (padded static buffers, replayed): decode
    # steps whole, mixed steps piecewise with attention between the pieces.
    "eager vs CUDA graphs": Setting(Setup({"enable_cuda_graphs": False}), Setup({"enable_cuda_graphs": True})),
    "padded mixed steps: few vs many graph sizes": Setting(Setup({"cuda_graph_sizes": [1, 8, 64]}),
                                                            Setup({"cuda_graph_sizes": [128]})),
    "serial vs overlapped step loop": Setting(Setup({"async_scheduling": False}), Setup({"async_scheduling": True})),
    "prefix cache off vs on": Setting(Setup({"enable_prefix_caching": False}), Setup({"enable_prefix_caching": True})),
    "chunk size A vs B": Setting(Setup(), Setup({"max_batch_tokens": ALTERNATIVE})),
    "block size A vs B": Setting(Setup(), Setup({"block_size_tokens": ALTERNATIVE})),
    "roomy vs tiny KV pool (preemption)": Setting(Setup(kv_pool="roomy"), Setup(kv_pool="tiny")),
    "one request at a time vs batched": Setting(Setup({"max_requests": 1}), Setup({"max_requests": 64})),
    "alone vs in a busy batch": Setting(Setup(), Setup(busy=True)),
    "TP=1 vs TP=2": Setting(Setup({"tensor_parallel_size": 1}), Setup({"tensor_parallel_size": 2}), share=1,
                            applies=lambda spec: spec.splits_over(2)),
    "TP=2 vs EP=2 (experts over the ranks)": Setting(Setup({"tensor_parallel_size": 2}),
                                                     Setup({"tensor_parallel_size": 2, "enable_expert_parallel": True}),
                                                     share=1, applies=lambda spec: spec.experts_split_over(2)),
    # bitwise in the batch-invariant search too: the MoE layers combine in expert order and the row-parallel layers
    # gather their input (where this CPU's GEMM columns keep their bits when split: test_vs_itself_invariant)
    "one rank vs EP=2 over the TP ranks": Setting(Setup(), Setup({"tensor_parallel_size": 2,
                                                                  "enable_expert_parallel": True}),
                                                  share=1, applies=lambda spec: spec.experts_split_over(2)),
    # two engine processes, each with half the requests (a lone one leaves the other idle, joining the MoE layers)
    "one rank vs data-parallel attention 2": Setting(Setup(), Setup({"data_parallel_size": 2,
                                                                     "enable_expert_parallel": True}),
                                                     share=1, applies=lambda spec: spec.attention_ranks_over(2)),
    "PP=2: one micro-batch vs two": Setting(Setup({"pipeline_parallel_size": 2, "pipeline_micro_batches": 1}),
                                            Setup({"pipeline_parallel_size": 2, "pipeline_micro_batches": 2}),
                                            share=1, applies=lambda spec: spec.stages_over(2)),
    "reference vs Triton kernels": Setting(Setup(kernels="reference"), Setup(kernels="triton"), share=1),
    # the CPU's C++ kernels (decode attention in place, rotary + KV write, norms, SwiGLU) against plain PyTorch
    "reference vs CPU kernels": Setting(Setup(kernels="reference"), Setup(kernels="cpu"), share=2),
    # speculation verifies several rows of a request in one forward: greedy tokens, seeded samples and log probs
    # must be those of one token per step
    "no speculation vs n-gram drafts": Setting(Setup(), Setup({"speculative": NGRAM}), share=4),
    "no speculation vs draft model": Setting(Setup(), Setup({"speculative": DRAFT_SELF}), share=2,
                                             applies=_text_model),
    # LoRA: rows without an adapter are the base model's whatever adapter rows share their steps, and an adapter
    # row is the same alone and among rows of the adapter and of the base
    "base rows beside adapter rows (LoRA)": Setting(Setup(busy=True), Setup(busy=True, adapter="others"), share=2,
                                                   applies=_text_model),
    "adapter rows: alone vs in a busy batch (LoRA)": Setting(Setup(adapter="all"), Setup(busy=True, adapter="all"),
                                                            share=2, applies=_text_model),
    # over TP ranks with experts split, an adapter's rows are gathered so that each rank applies the whole LoRA
    # product to them (the gathered-rows path): bitwise in the batch-invariant search as one rank's
    "adapter rows: one rank vs EP=2 over the TP ranks (LoRA)": Setting(
        Setup(adapter="all"), Setup({"tensor_parallel_size": 2, "enable_expert_parallel": True}, adapter="all"),
        share=1, applies=lambda spec: spec.experts_split_over(2) and not spec.vision),
}


def _schedule() -> list[str]:
    names = [name for name, setting in SETTINGS.items() for _ in range(setting.share)]
    random.Random(0).shuffle(names)
    return names


SCHEDULE = _schedule()


def setting_for(seed: int, spec: ModelSpec) -> str:
    """The row case ``seed`` compares: every row in turn, each as often as its share."""
    for offset in range(len(SCHEDULE)):
        name = SCHEDULE[(seed + offset) % len(SCHEDULE)]
        if SETTINGS[name].applies(spec):
            return name
    raise AssertionError(f"no setting applies to {spec.describe()}")
