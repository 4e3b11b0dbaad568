"""A GGUF file's metadata, read into the ``config.json`` this engine's :class:`~..config.ModelConfig` parses.

llama.cpp's converter writes a Hugging Face config as ``<arch>.<key>`` values (``llama.block_count``,
``qwen2.attention.head_count_kv``...) and the tokenizer's special ids as ``tokenizer.ggml.*``; this module turns
them back into the keys ``config.json`` would hold, so one parser (and its refusals) judges both formats.
Only the decoders this engine runs are read: another ``general.architecture`` is refused here, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader

from ..errors import UnsupportedModelError

#: The ``output.weight`` tensor: a file without it ties the output projection to the embedding.
OUTPUT_TENSOR = "output.weight"


@dataclass(frozen=True)
class GgufArchitecture:
    """One ``general.architecture`` this engine serves: the Hugging Face architecture it was converted from,
    and whether llama.cpp's converter permuted the query and key rows (its Llama converter reorders each head's
    rotary halves into interleaved pairs, for its own rotary kernel; Qwen's keeps Hugging Face's order)."""

    hf_architecture: str
    model_type: str
    permuted_qk: bool


GGUF_ARCHITECTURES: dict[str, GgufArchitecture] = {
    "llama": GgufArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GgufArchitecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": GgufArchitecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}
#: llama.cpp converts Mistral's decoders as ``llama`` (same tensors, same permutation); the name tells them apart.
MISTRAL = GgufArchitecture("MistralForCausalLM", "mistral", permuted_qk=True)

#: ``<arch>.<key>`` -> ``config.json`` key, for the numbers every architecture here has.
_ARCH_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_TOKEN_KEYS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id"}


def field(reader: GGUFReader, key: str) -> Any:
    """The value of one metadata key (a number, a string or a list), or None when the file has no such key."""
    found = reader.fields.get(key)
    return None if found is None else found.contents()


def architecture(reader: GGUFReader) -> GgufArchitecture:
    """The file's decoder, refused by its ``general.architecture`` when this engine does not serve it."""
    name = field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {name!r} is not supported: expected one of "
                                    f"{', '.join(GGUF_ARCHITECTURES)}")
    if name == "llama" and "mistral" in str(field(reader, "general.name") or "").lower():
        return MISTRAL
    return GGUF_ARCHITECTURES[name]


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The ``config.json`` of the model the file was converted from, as far as the engine reads it."""
    arch = architecture(reader)
    prefix = field(reader, "general.architecture")
    config: dict[str, Any] = {"architectures": [arch.hf_architecture], "model_type": arch.model_type}
    for key, name in _ARCH_KEYS.items():
        value = field(reader, f"{prefix}.{key}")
        if isinstance(value, list):  # llama.cpp writes per-layer lists where layers differ
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"GGUF {prefix}.{key} differs between layers ({value[:4]}...): "
                                            "layers of different shapes are not supported")
            value = value[0]
        if value is not None:
            config[name] = value
    for key, name in _TOKEN_KEYS.items():
        if field(reader, key) is not None:
            config[name] = field(reader, key)
    if "vocab_size" not in config:  # older converters leave it to the vocabulary's length
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    config["tie_word_embeddings"] = all(tensor.name != OUTPUT_TENSOR for tensor in reader.tensors)
    config["rope_scaling"] = _rope_scaling(reader, prefix)
    _check_rotary_dims(reader, prefix, config)
    return config


def _rope_scaling(reader: GGUFReader, prefix: str) -> dict[str, Any] | None:
    """``rope.scaling.*`` as ``config.json``'s ``rope_scaling`` (an unsupported type is refused by the config)."""
    kind = field(reader, f"{prefix}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": field(reader, f"{prefix}.rope.scaling.factor")}
    original = field(reader, f"{prefix}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _check_rotary_dims(reader: GGUFReader, prefix: str, config: dict[str, Any]) -> None:
    """Every dimension of a head rotates here: a file that rotates fewer is refused, naming the numbers."""
    rotary = field(reader, f"{prefix}.rope.dimension_count")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if rotary is not None and rotary != head_dim:
        raise UnsupportedModelError(f"GGUF {prefix}.rope.dimension_count is {rotary} but heads have {head_dim} "
                                    "dimensions: partial rotary embeddings are not supported")
