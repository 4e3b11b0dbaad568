"""GGUF files written by the ``gguf`` library's own writer from a Hugging Face checkpoint, as llama.cpp's converter
writes them: ``<arch>.*`` metadata, the library's tensor names, query and key rows of Llama-converted models
permuted for llama.cpp's rotary kernel, norms in F32 and the matrices in the tensor type asked for."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file

#: Hugging Face name (``{bid}``: the layer) -> the GGUF tensor llama.cpp writes it as.
GGUF_TENSORS = {
    "model.embed_tokens": MODEL_TENSOR.TOKEN_EMBD, "model.norm": MODEL_TENSOR.OUTPUT_NORM,
    "lm_head": MODEL_TENSOR.OUTPUT, "model.layers.{bid}.input_layernorm": MODEL_TENSOR.ATTN_NORM,
    "model.layers.{bid}.self_attn.q_proj": MODEL_TENSOR.ATTN_Q, "model.layers.{bid}.self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "model.layers.{bid}.self_attn.v_proj": MODEL_TENSOR.ATTN_V, "model.layers.{bid}.self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "model.layers.{bid}.self_attn.q_norm": MODEL_TENSOR.ATTN_Q_NORM,
    "model.layers.{bid}.self_attn.k_norm": MODEL_TENSOR.ATTN_K_NORM,
    "model.layers.{bid}.post_attention_layernorm": MODEL_TENSOR.FFN_NORM,
    "model.layers.{bid}.mlp.gate_proj": MODEL_TENSOR.FFN_GATE, "model.layers.{bid}.mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "model.layers.{bid}.mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
}
#: The quantization types the ``gguf`` library cannot quantize: random blocks with finite scales stand in.
RANDOM_BLOCK_TYPES = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
                      GGMLQuantizationType.Q6_K: (-2, 1)}  # each block's first byte of f16 scales, and how many


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    layer = base.split(".")[2] if base.startswith("model.layers.") else None
    template = base.replace(f"layers.{layer}.", "layers.{bid}.") if layer is not None else base
    return TENSOR_NAMES[GGUF_TENSORS[template]].format(bid=layer) + "." + suffix


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved (rows of any row type, bytes too)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def quantized_rows(weight: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """The rows of ``weight`` in ``qtype``'s bytes: quantized by the library, or random blocks where it cannot."""
    if qtype not in RANDOM_BLOCK_TYPES:
        return gguf.quants.quantize(weight, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (weight.shape[0], weight.shape[1] // block, size), dtype=np.uint8)
    start, count = RANDOM_BLOCK_TYPES[qtype]
    scales = rng.uniform(0.001, 0.01, (*blocks.shape[:2], count)).astype(np.float16)
    blocks[:, :, start:start + 2 * count or None] = scales.view(np.uint8)
    return blocks.reshape(weight.shape[0], -1)


def write_gguf(model_dir: Path, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               arch: str | None = None, name: str = "tiny", seed: int = 0,
               extra: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None) -> dict[str, np.ndarray]:
    """Write the checkpoint of ``model_dir`` to ``path`` as a GGUF file; returns each Hugging Face tensor as a
    reader of the file should see it (``gguf``'s own dequantization of the rows written). ``extra``: more tensors,
    by GGUF name, as raw rows of their type."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = arch or config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    rng = np.random.default_rng(seed)
    expected = {}
    for hf_name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        weight = tensor.to(torch.float32).numpy()
        tensor_type = qtype if weight.ndim == 2 else GGMLQuantizationType.F32
        rows = weight if tensor_type == GGMLQuantizationType.F32 else quantized_rows(weight, tensor_type, rng)
        expected[hf_name] = gguf.quants.dequantize(rows, tensor_type).reshape(weight.shape)
        if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            rows = llama_cpp_permute(rows, heads if "q_proj" in hf_name else kv_heads)
        writer.add_tensor(gguf_name(hf_name), rows, raw_dtype=None if rows is weight else tensor_type)
    for extra_name, (rows, tensor_type) in (extra or {}).items():
        writer.add_tensor(extra_name, rows, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
