"""vLLM's ``LoRARequest`` in the Python API: ``generate(..., lora_request=LoRARequest(name, id, path))``.

The adapter travels on each request's ``SamplingParams`` (``lora_name``, ``lora_path``); an engine started
with ``enable_lora`` loads it from ``lora_path`` on its first request and serves it under ``lora_name``
afterwards (engine.lora). ``lora_int_id`` is checked and kept for vLLM scripts; adapters are told apart by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from ..wire.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's fields: the adapter's name, a positive integer id, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {self.lora_path!r}")


def _check(item: Any) -> LoRARequest | None:
    if item is not None and not isinstance(item, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest (or None), got {type(item).__name__}")
    return item


def apply_lora(jobs: list[tuple[int, Any, SamplingParams]], lora_request: LoRARequest | Sequence | None,
               num_prompts: int) -> list[tuple[int, Any, SamplingParams]]:
    """The jobs ``(prompt index, prompt, params)`` under ``lora_request``: one for every prompt, or a list of one
    per prompt (as vLLM's ``LLM.generate``; ``None`` items run the base model)."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request holds {len(lora_request)} LoRARequests for {num_prompts} prompts: give "
                             "one, or one per prompt")
        per_prompt = [_check(item) for item in lora_request]
    else:
        per_prompt = [_check(lora_request)] * num_prompts
    out = []
    for index, prompt, params in jobs:
        adapter = per_prompt[index]
        if adapter is not None:
            params = msgspec.structs.replace(params, lora_name=adapter.lora_name, lora_path=adapter.lora_path or None)
        out.append((index, prompt, params))
    return out
