"""vLLM's ``vllm.inputs`` names, so that a script's ``from vllm.inputs import TokensPrompt`` works as
``from megatron_serve.inputs import TokensPrompt`` (the package's own home is :mod:`.client.prompts`)."""

from .client.prompts import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
