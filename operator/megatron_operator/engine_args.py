"""The engine command line a resource's engine pods run (docs/reference/cli.md): the flags from the spec.

Flags appear only away from the engine's defaults, so that a new field leaves the pod templates of existing
resources unchanged (their StatefulSets would roll otherwise).
"""

from __future__ import annotations

import json

from .kv_node import kv_node_flags
from .spec import InferenceSpec


def layout_flags(spec: InferenceSpec) -> list[str]:
    """The group's layout. Without ``spec.engine.parallelism``: ``--tensor-parallel N`` as always. With it, vLLM's
    flags: the attention ranks' ``--tensor-parallel-size``, ``--data-parallel-size`` (data-parallel attention)
    with ``--enable-expert-parallel`` (whole experts on every rank of a stage) and ``--pipeline-parallel-size``
    (docs/parallelism.md, On Kubernetes)."""
    if not spec.gang:
        return ["--tensor-parallel", str(spec.tensor)] if spec.tensor > 1 else []
    flags = ["--tensor-parallel-size", str(spec.attention_tensor)]
    if spec.pipeline > 1:
        flags += ["--pipeline-parallel-size", str(spec.pipeline)]
    if spec.data_parallel_attention > 1:
        flags += ["--data-parallel-size", str(spec.data_parallel_attention)]
    if spec.expert > 1:
        flags.append("--enable-expert-parallel")
        if spec.all2all_backend != "auto":
            flags += ["--all2all-backend", spec.all2all_backend]
    return flags


def lora_flags(spec: InferenceSpec) -> list[str]:
    """The engines' LoRA flags from ``spec.lora`` (none without it)."""
    lora = spec.lora
    if lora is None:
        return []
    flags = ["--enable-lora", "--max-loras", str(lora["maxLoras"]), "--max-lora-rank", str(lora["maxLoraRank"])]
    if "maxCpuLoras" in lora:
        flags += ["--max-cpu-loras", str(lora["maxCpuLoras"])]
    if lora["adapters"]:
        flags += ["--lora-modules", *(f"{a['name']}={a['path']}" for a in lora["adapters"])]
    return flags


#: spec.engine.speculative's fields -> the keys of vLLM's --speculative-config JSON
_SPECULATIVE_KEYS = {"method": "method", "numSpeculativeTokens": "num_speculative_tokens",
                     "promptLookupMin": "prompt_lookup_min", "promptLookupMax": "prompt_lookup_max", "model": "model",
                     "adaptive": "adaptive"}


def engine_flags(spec: InferenceSpec) -> list[str]:
    """Flags shared by the commands that build engines (docs/reference/cli.md)."""
    flags = ["--dtype", spec.dtype]
    if spec.max_sequence_length is not None:
        flags += ["--max-sequence-length", str(spec.max_sequence_length)]
    if spec.block_size_tokens is not None:
        flags += ["--block-size", str(spec.block_size_tokens)]
    if spec.max_batch_tokens is not None:
        flags += ["--max-batch-tokens", str(spec.max_batch_tokens)]
    flags.append("--prefix-caching" if spec.prefix_caching else "--no-prefix-caching")
    if not spec.cuda_graphs:  # on by default; the flag only when off, so existing pod templates stay unchanged
        flags.append("--no-cuda-graphs")
    if spec.batch_invariant:  # likewise off by default
        flags.append("--batch-invariant")
    if spec.quantization != "none":  # likewise: flags only away from the defaults
        flags += ["--quantization", spec.quantization]
    if spec.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if spec.kv_offloading_size is not None:
        flags += ["--kv-offloading-size", f"{spec.kv_offloading_size:g}"]
    if spec.kv_on_refit is not None:
        flags += ["--kv-on-refit", spec.kv_on_refit]
    flags += kv_node_flags(spec)
    if spec.speculative is not None:  # vLLM's JSON, its snake_case keys; sorted, so the pod template is stable
        fields = {_SPECULATIVE_KEYS[key]: value for key, value in spec.speculative.items()}
        flags += ["--speculative-config", json.dumps(fields, sort_keys=True)]
    return flags
