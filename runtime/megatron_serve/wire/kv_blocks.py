"""The KV blocks of one prefilled request, as they travel in prefill/decode disaggregation.

A prefill engine (``kv_role`` ``kv_producer``) computes a request's prompt and its first token, then sends its
KV blocks to the coordinator in ``KV_BLOCKS`` (engine -> coordinator), before the step that finishes the
request there; the coordinator hands the request on to a decode engine (``kv_consumer``): the same
``KV_BLOCKS`` first (coordinator -> engine), then ``ENGINE_SUBMIT`` with ``kv_transfer_params``
``{"do_remote_prefill": true}`` (Megatron-core's ``SUBMIT_REQUEST_WITH_KV`` in two messages), and the decode
engine continues from them without computing the prompt again. Every leg is an ordinary frame of the fleet's
connections: authenticated and encrypted as every other message (:mod:`megatron_serve.wire.security`).

A request's blocks travel in parts of at most :data:`MAX_PART_BYTES` (a frame holds 16 MiB; one part per
message keeps a step's other messages flowing between them): ``first_block`` says where a part starts.

The blocks are keyed by the weights' ``epoch`` they were computed under: an engine on other weights
computes the prompt itself rather than continue from them. Each tensor is one of the pool's block tensors
(values; with an fp8 cache, their scales too), ``[blocks, *block shape]``, as raw bytes.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

#: The most bytes of blocks one ``KV_BLOCKS`` carries (one block at least, whatever its size).
MAX_PART_BYTES = 8 * 2**20

#: Element sizes of the dtypes a block tensor may travel as (the pool's dtypes; e4m3 is fp8's values).
KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

Count = Annotated[int, msgspec.Meta(ge=0)]


class KVTensor(msgspec.Struct, array_like=True, frozen=True):
    """One block tensor of the pool for the blocks sent: ``shape`` is ``[blocks, *block shape]``."""

    dtype: str
    shape: tuple[Count, ...]
    data: bytes


class KVBlocks(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``KV_BLOCKS``: a part of the KV of request ``request_id``'s first ``num_tokens`` tokens, which fill
    ``num_blocks`` blocks of ``block_size`` tokens (the last one maybe partly), computed under weights ``epoch``:
    the blocks ``first_block`` on, as many as its tensors hold. (A message body
    as :class:`~megatron_serve.wire.body.Body` is; defined here so that the messages can name it.)"""

    request_id: str
    engine_id: str  # the prefill engine's registration (a message of an older one is stale)
    epoch: int
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    tensors: list[KVTensor]
    first_block: Count = 0

    @property
    def num_blocks(self) -> int:
        """The request's blocks (every part's)."""
        return -(-self.num_tokens // self.block_size)

    @property
    def part_blocks(self) -> int:
        """The blocks this part holds."""
        return self.tensors[0].shape[0] if self.tensors and self.tensors[0].shape else 0

    @property
    def num_bytes(self) -> int:
        return sum(len(tensor.data) for tensor in self.tensors)

    def problem(self) -> str | None:
        """Why these blocks cannot be used (the frame is dropped, naming it), or None."""
        if not self.tensors:
            return "KV_BLOCKS carries no tensor"
        if not self.part_blocks or self.first_block + self.part_blocks > self.num_blocks:
            return (f"KV_BLOCKS holds blocks {self.first_block} to {self.first_block + self.part_blocks - 1}: "
                    f"{self.num_blocks} blocks of {self.block_size} tokens hold {self.num_tokens} tokens")
        for index, tensor in enumerate(self.tensors):
            size = KV_DTYPES.get(tensor.dtype)
            if size is None:
                return f"KV_BLOCKS tensor {index} has dtype {tensor.dtype!r}; one of {', '.join(KV_DTYPES)} travels"
            if not tensor.shape or tensor.shape[0] != self.part_blocks:
                return (f"KV_BLOCKS tensor {index} has shape {list(tensor.shape)}, tensor 0 holds "
                        f"{self.part_blocks} blocks")
            if len(tensor.data) != math.prod(tensor.shape) * size:
                return (f"KV_BLOCKS tensor {index} has {len(tensor.data)} bytes, its shape {list(tensor.shape)} "
                        f"of {tensor.dtype} takes {math.prod(tensor.shape) * size}")
        return None


def remote_decode() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a request sent to a prefill engine (vLLM's shape): compute the prompt and
    the first token, then send the blocks on."""
    return {"do_remote_decode": True}


def remote_prefill(prefill_engine_id: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a request sent to a decode engine right after its blocks (vLLM's shape):
    continue from them."""
    return {"do_remote_prefill": True, "remote_engine_id": prefill_engine_id}


def wants_remote_decode(kv_transfer_params: dict[str, Any] | None) -> bool:
    return bool(kv_transfer_params) and kv_transfer_params.get("do_remote_decode") is True


def wants_remote_prefill(kv_transfer_params: dict[str, Any] | None) -> bool:
    return bool(kv_transfer_params) and kv_transfer_params.get("do_remote_prefill") is True
