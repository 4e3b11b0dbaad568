"""vLLM's ``vllm.sampling_params`` names (``SamplingParams``, ``RequestOutputKind``, ``StructuredOutputsParams`` and
its older name ``GuidedDecodingParams``), so that replacing ``vllm`` by ``megatron_serve`` in imports is enough; the
definitions live in :mod:`.wire.sampling_params`, where the wire reads them."""

from .wire.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.10 for the same fields

__all__ = ["GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
