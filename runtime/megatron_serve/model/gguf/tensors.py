"""A GGUF file's tensors, under their Hugging Face names, dequantized by the ``gguf`` library as they are read.

The loader takes Hugging Face names (:func:`..loader.load_weights`), so each GGUF name (``blk.3.attn_q.weight``,
from the ``gguf`` library's own table) is mapped back to the one a Hugging Face checkpoint of the same decoder
holds (``model.layers.3.self_attn.q_proj.weight``), and llama.cpp's reordering of the query and key rows of
Llama-converted files is undone. Each tensor is dequantized to float32 when it is reached, one at a time; the
loader's copy into the parameters rounds it once to the serving dtype.

:func:`check_tensors` reads no tensor data: a file with a tensor type or a tensor this engine cannot load is
refused before anything starts, naming the tensor and its type.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from ..errors import UnsupportedModelError
from .metadata import architecture, field

#: The tensor types served: llama.cpp's common quantizations, and plain floats.
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))

#: Each GGUF tensor of a Llama-family decoder -> its Hugging Face name (``{bid}``: the layer).
_HF_NAMES = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
    MODEL_TENSOR.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    MODEL_TENSOR.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    MODEL_TENSOR.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm",
    MODEL_TENSOR.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
    MODEL_TENSOR.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    MODEL_TENSOR.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
}
_BY_GGUF_NAME = {TENSOR_NAMES[tensor]: hf for tensor, hf in _HF_NAMES.items()}
_LAYER = re.compile(r"blk\.(\d+)\.")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; a tensor with no place in these decoders is refused by name
    (``rope_freqs.weight``, Llama 3.1's rotary scaling as a tensor, among them)."""
    base, dot, suffix = gguf_name.rpartition(".")
    layer = _LAYER.match(base)
    template = _BY_GGUF_NAME.get(_LAYER.sub("blk.{bid}.", base, count=1) if layer else base)
    if not dot or template is None:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in the decoders served here")
    return template.format(bid=layer[1] if layer else "") + f".{suffix}"


def check_tensors(reader: GGUFReader) -> None:
    """Refuse, before any data is read, a tensor of a type not served or with no place in the model."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported: "
                f"expected one of {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
        hf_name(tensor.name)


def gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face name, float32 tensor)`` for every tensor of the file, each dequantized when reached."""
    reader = GGUFReader(path)
    check_tensors(reader)
    permuted = architecture(reader).permuted_qk
    prefix = field(reader, "general.architecture")
    heads = field(reader, f"{prefix}.attention.head_count")
    kv_heads = field(reader, f"{prefix}.attention.head_count_kv") or heads
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        weight = _dequantized(tensor)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _unpermute(weight, heads if "q_proj" in name else kv_heads)
        yield name, weight


def _dequantized(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor in float32, of its Hugging Face shape (GGUF lists dimensions innermost first)."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
    return torch.from_numpy(values if values.flags.writeable else values.copy())  # F32 data is the mapped file


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Llama converter, which stores each head's rows ``[x0, x_half, x1, x_half+1, ...]``
    (rotary pairs side by side) where Hugging Face's rotate-half layout has ``[x0, x1, ..., x_half, ...]``."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
