"""Llama-family decoder: configuration, layers, model and weight loading.

The names below are imported on first use (PEP 562): the server's processes read only a model's config
(``model.config``, ``model.vision_config``) and run without torch, which ``.llama`` and ``.loader`` import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..package import lazy_exports

_EXPORTS = {"ModelConfig": ".config", "UnsupportedModelError": ".errors", "LlamaForCausalLM": ".llama",
            "load_model": ".loader"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .config import ModelConfig
    from .errors import UnsupportedModelError
    from .llama import LlamaForCausalLM
    from .loader import load_model


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
