"""The checkpoint the engine serves, read whole for a trainer's model (the Megatron-core and TorchTitan adapters map
its Hugging Face names onto their own): one reader, so both refuse a folder without weights the same way."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model_dir``'s ``*.safetensors`` files, by its Hugging Face name."""
    from safetensors.torch import load_file  # noqa: PLC0415 - comes with transformers

    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(path)))
    if not state:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    return state
