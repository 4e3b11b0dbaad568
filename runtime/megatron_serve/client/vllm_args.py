"""vLLM's ``LLM(...)`` keywords: what each one sets here, read from the same table as ``vllm serve``'s options.

The keywords this module applies are :data:`LLM_KEYWORDS` (vLLM's name -> our setting). Every
other keyword is one of ``vllm serve``'s options (each ``EngineArgs`` field is one: ``--swap-space``
is ``swap_space=``), and its fate is that option's row in
:data:`megatron_serve.client.vllm_options.VLLM_OPTIONS`, the one table that also drives the
CLI and docs/vllm-mapping.md: *accepted* keywords change nothing and log a warning saying why,
*refused* ones raise ``ValueError`` with the row's reason, and a keyword in neither is a
``TypeError`` naming it, as Python's own for an unexpected keyword. A keyword given as ``None``
(or ``False`` for an option that is a switch) is vLLM's default and is not looked at further.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .vllm_options import VLLM_OPTIONS, Scope, Status, VllmOption

logger = logging.getLogger(__name__)

#: vLLM's ``dtype`` spellings -> ours (``auto``: float32 on CPU, the checkpoint's on GPU).
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}
#: ``wake_up`` tags: what vLLM's sleep mode restores separately (here both come back together).
WAKE_UP_TAGS = ("weights", "kv_cache")


def _dtype(value: Any) -> Any:
    if isinstance(value, str):
        if value not in DTYPES:
            raise ValueError(f"dtype={value!r}: expected one of {', '.join(DTYPES)} or a torch.dtype")
        return DTYPES[value]
    return value  # a torch.dtype: InferenceConfig checks it


def _quantization(value: str) -> str | None:
    if value in ("auto", "none"):
        return None  # the checkpoint's own weights (an FP8 checkpoint's included)
    if value != "fp8":
        raise ValueError(f"quantization={value!r} is not supported by this build (supported: auto, none, fp8)")
    return value


@dataclass(frozen=True)
class Keyword:
    """One implemented keyword: the ``InferenceConfig`` field it sets (``None``: the constructor's own)."""

    field: str | None
    convert: Callable[[Any], Any] = lambda value: value
    note: str = ""  # how it differs from vLLM's (docs/python-api.md)


#: vLLM's ``LLM`` keywords applied here, and how.
LLM_KEYWORDS: dict[str, Keyword] = {
    "tokenizer": Keyword(None, note="a directory"),
    "revision": Keyword(None, note="of a Hub id"),
    "download_dir": Keyword(None, note="the Hugging Face cache Hub ids are read from"),
    "generation_config": Keyword(None, note="`auto`, `vllm` (= `none`) or a directory"),
    "data_parallel_size": Keyword(None, note="more than 1 starts a local fleet of that many engines"),
    "enable_sleep_mode": Keyword(None, note="starts a local fleet (one engine): `sleep`/`wake_up` need one"),
    "disable_log_stats": Keyword(None, note="`LLM` logs no periodic stats either way"),
    "dtype": Keyword("dtype", _dtype),
    "max_model_len": Keyword("max_sequence_length", int),
    "tensor_parallel_size": Keyword("tensor_parallel_size", int),
    "gpu_memory_utilization": Keyword("kv_cache_memory_fraction", float,
                                      note="of the memory left after the weights (vLLM: of the whole GPU)"),
    "enforce_eager": Keyword("enable_cuda_graphs", lambda value: not value),
    "enable_prefix_caching": Keyword("enable_prefix_caching", bool),
    "max_num_seqs": Keyword("max_requests", int),
    "max_num_batched_tokens": Keyword("max_batch_tokens", int),
    "seed": Keyword("seed", int),
    "quantization": Keyword("quantization", _quantization, note="`fp8`, `auto`, `none`; others refused"),
    "kv_cache_dtype": Keyword("kv_cache_dtype", str, note="`auto`, `fp8`, `fp8_e4m3`"),
    "block_size": Keyword("block_size_tokens", int),
    "num_gpu_blocks_override": Keyword("num_kv_blocks", int),
    "cuda_graph_sizes": Keyword("cuda_graph_sizes", list),
    "async_scheduling": Keyword("async_scheduling", bool),
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
        return int(self.options.get("data_parallel_size") or 1)

    @property
    def use_coordinator(self) -> bool:
        return self.num_engines > 1 or bool(self.options.get("enable_sleep_mode"))


def _check_row(name: str, value: Any, row: VllmOption) -> None:
    """A value an accepted or implemented row's parser would refuse is refused here too, naming the keyword."""
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
            if keyword.field is None:
                parsed.options[name] = value
            else:
                parsed.config[keyword.field] = keyword.convert(value)
            continue
        row = SERVE_ROWS.get(name)
        if row is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}: not one of vLLM's options this "
                            "project knows (docs/python-api.md lists them)")
        if value is None or value is False:
            continue  # vLLM's default: nothing asked for
        if row.status is Status.REFUSED:
            raise ValueError(f"{name}: {row.reason}")
        if row.scope is not Scope.ENGINE:
            raise ValueError(f"{name} is served by megatron-serve run/serve (the HTTP server), not by LLM")
        _check_row(name, value, row)
        if row.status is Status.ACCEPTED:
            parsed.warnings.append(f"{name} is accepted for vLLM compatibility and changes nothing: {row.reason}")
    dp = parsed.options.get("data_parallel_size", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}")
    return parsed


def log_warnings(parsed: LLMArguments) -> None:
    for line in parsed.warnings:
        logger.warning(line)


def refuse_lora(lora_request: Any) -> None:
    """``lora_request``: only ``None`` (no adapter) is served; an adapter is refused with the table's reason."""
    if lora_request is not None:
        raise ValueError(f"lora_request: {SERVE_ROWS['enable_lora'].reason}")


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
    from ..hub import resolve_model  # noqa: PLC0415 - the Hub client only when a model is named

    return resolve_model(model, revision=options.get("revision"), cache_dir=options.get("download_dir"))
