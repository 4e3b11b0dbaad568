"""vLLM's ``LLM(...)`` keywords: what each one sets here, read from the same table as ``vllm serve``'s options.

The keywords this module applies are :data:`LLM_KEYWORDS` (vLLM's name -> our setting). Every
other keyword is one of ``vllm serve``'s options (each ``EngineArgs`` field is one: ``--swap-space``
is ``swap_space=``), and its fate is that option's row in
:data:`megatron_serve.client.vllm_options.VLLM_OPTIONS`, the one table that also drives the
CLI and docs/vllm-mapping.md: *accepted* keywords change nothing and log a warning saying why,
*refused* ones raise ``ValueError`` with the row's reason, *implemented* ones that ``LLM`` does not
apply (the HTTP server's, or an engine option not yet wired here) raise ``ValueError`` rather than
be ignored, and a keyword in no row is a ``TypeError`` naming it, as Python's own for an unexpected
keyword. A keyword given as ``None``
(or ``False`` for an option that is a switch) is vLLM's default and is not looked at further.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..wire.kv_events import parse_kv_events_config
from .vllm_options import (ALL2ALL_BACKENDS, CHECKPOINT_QUANTIZATIONS, KV_CACHE_DTYPES, QUANTIZATION_SCHEMES,
                           VLLM_OPTIONS, Status, VllmOption)

logger = logging.getLogger(__name__)

#: vLLM's ``dtype`` spellings -> ours (``auto``: float32 on CPU, the checkpoint's on GPU).
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}
#: ``wake_up`` tags: what vLLM's sleep mode restores separately (here both come back together).
WAKE_UP_TAGS = ("weights", "kv_cache")


def _dtype(value: Any) -> Any:
    if isinstance(value, str):
        if value not in DTYPES:
            raise ValueError(f"expected one of {', '.join(DTYPES)} or a torch.dtype")
        return DTYPES[value]
    return value  # a torch.dtype: InferenceConfig checks it


def _quantization(value: Any) -> str | None:
    if value in CHECKPOINT_QUANTIZATIONS:
        return None  # the checkpoint's own weights (an FP8 checkpoint's, a GGUF file's included)
    if value not in QUANTIZATION_SCHEMES:
        raise ValueError(f"not supported by this build (supported: {', '.join(QUANTIZATION_SCHEMES)})")
    return value


def _all2all_backend(value: Any) -> str:
    if value not in ALL2ALL_BACKENDS:
        raise ValueError(f"not supported by this build (supported: {', '.join(ALL2ALL_BACKENDS)})")
    return value


def _kv_cache_dtype(value: Any) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"not supported by this build (supported: {', '.join(KV_CACHE_DTYPES)})")
    return value


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("must be a positive integer")
    return value


def _non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be a non-negative integer")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be True or False")
    return value


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError("must be a fraction in (0, 1]")
    return float(value)


def _sizes(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("must be a non-empty list of positive integers")
    return [_positive_int(size) for size in value]


def _gib(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError("must be a positive number of GiB")
    return float(value)


def _speculative(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("must be a dict of vLLM's speculative-config fields (method, num_speculative_tokens, ...)")
    return value


def _eplb_config(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("must be a dict of vLLM's eplb-config fields (window_size, step_interval, "
                         "num_redundant_experts, log_balancedness)")
    return value


def _anything(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Keyword:
    """One implemented keyword: the ``InferenceConfig`` field it sets (``None``: the constructor's own)."""

    field: str | None
    convert: Callable[[Any], Any] = _anything  # checks the value (ValueError saying what is wrong) and converts it


#: vLLM's ``LLM`` keywords applied here, and how.
LLM_KEYWORDS: dict[str, Keyword] = {
    "tokenizer": Keyword(None),  # a directory
    "revision": Keyword(None),  # of a Hub id
    "download_dir": Keyword(None),  # the Hugging Face cache Hub ids are read from and downloaded to
    "generation_config": Keyword(None),  # auto, vllm (= none) or a directory
    # more than 1: a local fleet of that many engines, or with enable_expert_parallel one group of that many
    # data-parallel attention ranks sharing the experts (LLMArguments.num_engines)
    "data_parallel_size": Keyword(None, _positive_int),
    "enable_sleep_mode": Keyword(None, _flag),  # a local fleet of one engine: sleep/wake_up need one
    "disable_log_stats": Keyword(None, _flag),  # LLM logs no periodic stats either way
    "pipeline_parallel_size": Keyword("pipeline_parallel_size", _positive_int),
    "dtype": Keyword("dtype", _dtype),
    "max_model_len": Keyword("max_sequence_length", _positive_int),
    "tensor_parallel_size": Keyword("tensor_parallel_size", _positive_int),
    "enable_expert_parallel": Keyword("enable_expert_parallel", _flag),
    "all2all_backend": Keyword("all2all_backend", _all2all_backend),
    "enable_eplb": Keyword("enable_eplb", _flag),
    "eplb_config": Keyword("eplb_config", _eplb_config),
    "gpu_memory_utilization": Keyword("kv_cache_memory_fraction", _fraction),  # of the memory left after weights
    "enforce_eager": Keyword("enable_cuda_graphs", lambda value: not _flag(value)),
    "enable_prefix_caching": Keyword("enable_prefix_caching", _flag),
    "max_num_seqs": Keyword("max_requests", _positive_int),
    "max_num_batched_tokens": Keyword("max_batch_tokens", _positive_int),
    "long_prefill_token_threshold": Keyword("long_prefill_token_threshold", _non_negative_int),
    "max_long_partial_prefills": Keyword("max_long_partial_prefills", _positive_int),
    "scheduling_policy": Keyword("scheduling_policy", str),  # fcfs or priority (InferenceConfig names a bad one)
    "seed": Keyword("seed", _int),
    "quantization": Keyword("quantization", _quantization),
    "kv_cache_dtype": Keyword("kv_cache_dtype", _kv_cache_dtype),
    "block_size": Keyword("block_size_tokens", _positive_int),
    "num_gpu_blocks_override": Keyword("num_kv_blocks", _positive_int),
    "cuda_graph_sizes": Keyword("cuda_graph_sizes", _sizes),
    "async_scheduling": Keyword("async_scheduling", _flag),
    "enable_lora": Keyword("enable_lora", _flag),
    "max_loras": Keyword("max_loras", _positive_int),
    "max_lora_rank": Keyword("max_lora_rank", _positive_int),
    "max_cpu_loras": Keyword("max_cpu_loras", _positive_int),
    "speculative_config": Keyword("speculative", _speculative),
    "kv_offloading_size": Keyword("kv_offloading_size", _gib),
    "kv_events_config": Keyword("kv_events_config", parse_kv_events_config),
    "kv_offloading_backend": Keyword("kv_offloading_backend", str),
}


def _keyword(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


#: ``vllm serve``'s rows by the keyword each flag is as an ``LLM`` argument (short flags like ``-tp`` are none).
SERVE_ROWS: dict[str, VllmOption] = {_keyword(flag): row for row in VLLM_OPTIONS for flag in row.flags
                                     if flag.startswith("--")}


@dataclass
class LLMArguments:
    """What vLLM's keywords come to: the settings of a ``MegatronLLM`` and the warnings to log."""

    config: dict[str, Any] = field(default_factory=dict)  # InferenceConfig keywords
    options: dict[str, Any] = field(default_factory=dict)  # the LLM's own keywords (tokenizer, revision, ...)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_engines(self) -> int:
        """Engine groups: ``data_parallel_size`` replicas, or one group of that many attention ranks under expert
        parallelism (vLLM's meaning: ep = tp x dp), which :func:`parse_llm_keywords` puts in the config."""
        if self.config.get("enable_expert_parallel"):
            return 1
        return int(self.options.get("data_parallel_size") or 1)

    @property
    def use_coordinator(self) -> bool:
        return (int(self.options.get("data_parallel_size") or 1) > 1 or self.num_engines > 1
                or bool(self.options.get("enable_sleep_mode")))



def _check_row(name: str, value: Any, row: VllmOption) -> None:
    """A value an accepted row's parser would refuse (a choice it lacks) is refused here too, naming the keyword."""
    spec = row.spec or {}
    text = str(value)
    if "choices" in spec and text not in spec["choices"]:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(str, spec['choices']))}")
    convert = spec.get("type")
    if convert is not None:
        try:
            convert(text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{name}={value!r}: {exc}") from None


def parse_llm_keywords(keywords: dict[str, Any]) -> LLMArguments:
    """Sort vLLM's ``LLM(...)`` keywords into settings, warnings and refusals (see the module docstring)."""
    parsed = LLMArguments()
    for name, value in keywords.items():
        keyword = LLM_KEYWORDS.get(name)
        if keyword is not None:
            if value is None:
                continue
            try:
                converted = keyword.convert(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}={value!r}: {exc}") from None
            if keyword.field is None:
                parsed.options[name] = converted
            else:
                parsed.config[keyword.field] = converted
            continue
        row = SERVE_ROWS.get(name)
        if row is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}: not one of vLLM's options this "
                            "project knows (docs/python-api.md lists them)")
        if value is None or value is False:
            continue  # vLLM's default: nothing asked for
        if row.status is Status.REFUSED:
            raise ValueError(f"{name}: {row.reason}")
        if row.status is not Status.ACCEPTED:  # implemented by the commands, not applied by LLM: never ignored
            raise ValueError(f"{name} is taken by megatron-serve run/serve, not by LLM")
        _check_row(name, value, row)
        parsed.warnings.append(f"{name} is accepted for vLLM compatibility and changes nothing: {row.reason}")
    if parsed.config.get("enable_expert_parallel") and parsed.options.get("data_parallel_size", 1) > 1:
        parsed.config["data_parallel_size"] = parsed.options["data_parallel_size"]  # a fleet of one group's ranks
    return parsed


def log_warnings(parsed: LLMArguments) -> None:
    for line in parsed.warnings:
        logger.warning(line)


def wake_up_plan(tags: list[str] | None) -> bool:
    """Whether ``wake_up(tags)`` lets the fleet run afterwards: not when it restores only the weights (vLLM's
    first step before new weights are loaded); unknown tags are refused by name."""
    if tags is None:
        return True
    if isinstance(tags, (str, bytes)) or not isinstance(tags, (list, tuple)):
        raise TypeError(f"tags must be a list of {', '.join(WAKE_UP_TAGS)} (or None), got {tags!r}")
    unknown = [tag for tag in tags if tag not in WAKE_UP_TAGS]
    if unknown:
        raise ValueError(f"wake_up: unknown tag(s) {', '.join(map(repr, unknown))}: expected {', '.join(WAKE_UP_TAGS)}")
    return list(tags) != ["weights"]


def model_directory(model: str | os.PathLike, options: dict[str, Any]) -> Any:
    """``model`` resolved with vLLM's ``revision`` and ``download_dir`` (a Hub id's snapshot, or the path)."""
    from ..model.hub import resolve_model  # noqa: PLC0415 - the Hub client only when a model is named

    return resolve_model(model, revision=options.get("revision"), cache_dir=options.get("download_dir"),
                         tokenizer=options.get("tokenizer") is None)
