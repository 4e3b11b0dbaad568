"""Llama-family decoder: configuration, layers, model and weight loading.

The names below are imported on first use (PEP 562): the server's processes read only a model's config
(``model.config``, ``model.vision_config``) and run without torch, which ``.llama`` and ``.loader`` import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"ModelConfig": ".config", "UnsupportedModelError": ".errors", "LlamaForCausalLM": ".llama",
            "load_model": ".loader"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .config import ModelConfig
    from .errors import UnsupportedModelError
    from .llama import LlamaForCausalLM
    from .loader import load_model


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule not imported yet: ``from megatron_serve.model import mrope`` imports it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
