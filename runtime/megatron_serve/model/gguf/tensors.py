"""A GGUF file's tensors, under their Hugging Face names, dequantized by the ``gguf`` library as they are read.

The loader takes Hugging Face names (:func:`..loader.load_weights`), so each GGUF name (``blk.3.attn_q.weight``,
from the ``gguf`` library's own table) is mapped back to the one a Hugging Face checkpoint of the same decoder
holds (``model.layers.3.self_attn.q_proj.weight``), and llama.cpp's reordering of the query and key rows of
Llama-converted files is undone. Each tensor is dequantized to float32 when it is reached, one at a time; the
loader's copy into the parameters rounds it once to the serving dtype.

The file's directory (:mod:`.view`) keeps its tensor table (:func:`save_table`): each tensor's name, type, shape and
place in the file, and the head counts. A load maps the file and slices each tensor from that table, without the
``gguf`` library's reader, which parses every metadata value (a 49k-token vocabulary: 4 s of CPU); a file without
a table beside it (given directly, or a directory of an earlier build) is read with the reader.

:func:`check_tensors` reads no tensor data: a file with a tensor type or a tensor this engine cannot load is
refused before anything starts, naming the tensor and its type.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFReader
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
#: The tensor table beside the file's link in its directory (:func:`save_table`).
TABLE_FILE = "gguf_tensors.json"
#: The most values one call of the library's dequantizer makes: its own grouping (16 rows a call) pays numpy's
#: per-call cost thousands of times per matrix, and chunks of 4 MB or more (a whole matrix) make temporaries that
#: leave the caches and are mapped afresh each call; 1 MB chunks dequantize SmolLM2 in 0.8 CPU-s, from 1.9. The
#: blocks are dequantized one by one either way, so the numbers are the same.
_CHUNK_VALUES = 1 << 18
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


def tensor_table(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """What a load needs of the file, read once: its identity (size, modification time), whether the query and key
    rows are permuted and the head counts that undo it, and each tensor's name, type, GGUF shape and byte range."""
    prefix = field(reader, "general.architecture")
    heads = field(reader, f"{prefix}.attention.head_count")
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "permuted_qk": architecture(reader).permuted_qk,
            "heads": heads, "kv_heads": field(reader, f"{prefix}.attention.head_count_kv") or heads,
            "tensors": [{"name": tensor.name, "type": tensor.tensor_type.name, "shape": tensor.shape.tolist(),
                         "offset": tensor.data_offset, "bytes": tensor.n_bytes} for tensor in reader.tensors]}


def save_table(reader: GGUFReader, path: Path, directory: Path) -> None:
    """Keep the tensor table of the file ``path`` in ``directory``, the file's directory (where its link is)."""
    (directory / TABLE_FILE).write_text(json.dumps(tensor_table(reader, path)))


def _table(path: Path) -> dict[str, Any]:
    """The table saved beside ``path`` when it is this very file's (its size and modification time), else the one
    read from the file (a file given directly, a directory made before tables were kept)."""
    saved = path.parent / TABLE_FILE
    if saved.is_file():
        table = json.loads(saved.read_text())
        stat = os.stat(path)
        if (table["size"], table["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
            return table
    reader = GGUFReader(path)
    check_tensors(reader)
    return tensor_table(reader, path)


def gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face name, float32 tensor)`` for every tensor of the file, each dequantized when reached."""
    table = _table(Path(path))
    data = np.memmap(path, mode="r")
    for entry in table["tensors"]:
        name = hf_name(entry["name"])
        weight = _dequantized(data, entry)
        if table["permuted_qk"] and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _unpermute(weight, table["heads"] if "q_proj" in name else table["kv_heads"])
        yield name, weight


def _dequantized(data: np.ndarray, entry: dict[str, Any]) -> torch.Tensor:
    """The tensor in float32, of its Hugging Face shape (GGUF lists dimensions innermost first), dequantized by the
    library's own dequantizer of its type, a chunk of rows at a time."""
    qtype = GGMLQuantizationType[entry["type"]]
    shape = tuple(reversed(entry["shape"]))
    raw = data[entry["offset"]:entry["offset"] + entry["bytes"]]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = dequantize(raw, qtype).reshape(shape)
        return torch.from_numpy(values if values.flags.writeable else values.copy())  # F32 data is the mapped file
    quant = getattr(gguf.quants, qtype.name)  # the class the library's dequantize() calls (BF16, Q4_0...)
    quant.init_grid()
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    width = shape[-1]
    rows = raw.reshape(-1, width // block * block_bytes)
    values = np.empty((rows.shape[0], width), np.float32)
    step = max(1, _CHUNK_VALUES // width)
    for start in range(0, rows.shape[0], step):
        values[start:start + step] = quant.dequantize_rows(rows[start:start + step])
    return torch.from_numpy(values.reshape(shape))


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Llama converter, which stores each head's rows ``[x0, x_half, x1, x_half+1, ...]``
    (rotary pairs side by side) where Hugging Face's rotate-half layout has ``[x0, x1, ..., x_half, ...]``."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
