"""The KV blocks of one prefilled request, as they travel in prefill/decode disaggregation.

A prefill engine (``kv_role`` ``kv_producer``) computes a request's prompt and its first token, then sends its
KV blocks to the coordinator in ``KV_BLOCKS`` (engine -> coordinator), before the step that finishes the
request there; the coordinator hands the request on to a decode engine (``kv_consumer``) in ``ENGINE_SUBMIT``
with the same blocks beside it (Megatron-core's ``SUBMIT_REQUEST_WITH_KV``), and the decode engine continues
from them without computing the prompt again. Both legs are ordinary frames of the fleet's connections:
authenticated and encrypted as every other message (:mod:`megatron_serve.wire.security`).

The blocks are keyed by the weights' ``epoch`` they were computed under: an engine on other weights
computes the prompt itself rather than continue from them. Each tensor is one of the pool's block tensors
(values; with an fp8 cache, their scales too), ``[blocks, *block shape]``, as raw bytes.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

#: Element sizes of the dtypes a block tensor may travel as (the pool's dtypes; e4m3 is fp8's values).
KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

Count = Annotated[int, msgspec.Meta(ge=0)]


class KVTensor(msgspec.Struct, array_like=True, frozen=True):
    """One block tensor of the pool for the blocks sent: ``shape`` is ``[blocks, *block shape]``."""

    dtype: str
    shape: tuple[Count, ...]
    data: bytes


class KVBlocks(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``KV_BLOCKS``: the KV of request ``request_id``'s first ``num_tokens`` tokens, in whole blocks of
    ``block_size`` tokens (the last one maybe partly filled), computed under weights ``epoch``. (A message body
    as :class:`~megatron_serve.wire.messages.Body` is; defined here so that the messages can name it.)"""

    request_id: str
    engine_id: str  # the prefill engine's registration (a message of an older one is stale)
    epoch: int
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    tensors: list[KVTensor]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def num_bytes(self) -> int:
        return sum(len(tensor.data) for tensor in self.tensors)

    def problem(self) -> str | None:
        """Why these blocks cannot be used (the frame is dropped, naming it), or None."""
        if not self.tensors:
            return "KV_BLOCKS carries no tensor"
        for index, tensor in enumerate(self.tensors):
            size = KV_DTYPES.get(tensor.dtype)
            if size is None:
                return f"KV_BLOCKS tensor {index} has dtype {tensor.dtype!r}; one of {', '.join(KV_DTYPES)} travels"
            if not tensor.shape or tensor.shape[0] != self.num_blocks:
                return (f"KV_BLOCKS tensor {index} has shape {list(tensor.shape)}: {self.num_blocks} blocks of "
                        f"{self.block_size} tokens hold {self.num_tokens} tokens")
            if len(tensor.data) != math.prod(tensor.shape) * size:
                return (f"KV_BLOCKS tensor {index} has {len(tensor.data)} bytes, its shape {list(tensor.shape)} "
                        f"of {tensor.dtype} takes {math.prod(tensor.shape) * size}")
        return None


def remote_decode() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a request sent to a prefill engine (vLLM's shape): compute the prompt and
    the first token, then send the blocks on."""
    return {"do_remote_decode": True}


def wants_remote_decode(kv_transfer_params: dict[str, Any] | None) -> bool:
    return bool(kv_transfer_params) and kv_transfer_params.get("do_remote_decode") is True
