"""Give a tiny checkpoint (:func:`.tiny.make_tiny_model`) an MTP layer, DeepSeek-V3 style, for tests and benchmarks.

``copy_layer``: the MTP layer is a copy of decoder layer 0 that reads the next token's embedding only
(``eh_proj = [I | 0]``, the embedding rows rescaled to RMS 1 so ``enorm`` leaves them as they are); on a
one-layer target it then computes what the target computes one position later (its attention lacks only the
first token), so its guesses are mostly the target's own; ``hidden_weight`` mixes in the hidden state (random
weights of that scale), so that guesses depend on it too. Otherwise its weights are random (``seed``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MTP_EXTRAS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "embed_tokens.weight", "shared_head.head.weight")


def add_mtp_layer(path: str | Path, seed: int = 0, copy_layer: bool = False, hidden_weight: float = 0.0) -> Path:
    """Append ``model.layers.{num_hidden_layers}.*`` to ``path``'s safetensors and set ``num_nextn_predict_layers``."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    hidden, index = config["hidden_size"], config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)
    embed = tensors["model.embed_tokens.weight"]
    if copy_layer:
        embed = embed / embed.pow(2).mean(-1, keepdim=True).add(config.get("rms_norm_eps", 1e-6)).sqrt()
        tensors["model.embed_tokens.weight"] = embed.contiguous()
    prefix = f"model.layers.{index}."
    for name, tensor in list(tensors.items()):
        if name.startswith("model.layers.0."):
            rest = name[len("model.layers.0."):]
            value = tensor.clone() if copy_layer or "norm" in rest else torch.randn(
                tensor.shape, generator=generator, dtype=tensor.dtype) * 0.05
            tensors[prefix + rest] = value
    eh_proj = torch.randn(hidden, 2 * hidden, generator=generator) * 0.05
    if copy_layer:
        eh_proj = torch.cat([torch.eye(hidden), hidden_weight * eh_proj[:, hidden:]], dim=1)
    tensors.update({prefix + "enorm.weight": torch.ones(hidden), prefix + "hnorm.weight": torch.ones(hidden),
                    prefix + "eh_proj.weight": eh_proj,
                    prefix + "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
                    prefix + "embed_tokens.weight": embed.clone(),
                    prefix + "shared_head.head.weight": tensors.get("lm_head.weight", embed).clone()})
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
