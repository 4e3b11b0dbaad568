"""Llama-family decoder: configuration, layers, model and weight loading."""

from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "UnsupportedModelError", "load_model"]
