"""The weights an FP8 engine computes with in ``--batch-invariant``, written as a checkpoint a trainer loads.

In the mode an FP8 layer runs weight-only: each call dequantizes its weight (``megatron_kernels.fp8.dequantize``:
``weight * scale`` in float32, rounded once to the model dtype) and multiplies unquantized activations. A
trainer gets the engine's log probs by loading those dequantized weights in the engine's dtype with the
recipe (docs/batch-invariance.md). :func:`write_dequantized_checkpoint` writes them in one call, for an FP8
checkpoint (its scales, per tensor, per row or per block) and for ``--quantization fp8`` (each decoder
linear quantized per row as the engine does at load, then dequantized). Which tensors are FP8 is the
engine's own decision: an uninitialised engine model (on the meta device, no memory) says which of its
parameters each checkpoint tensor fills, and those in FP8 are dequantized; every other tensor is copied.
Values are written in float32: loading them in bfloat16 rounds each once, as the engine's dequantize does.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_kernels.fp8 import FP8_DTYPE, dequantize, quantize

from .config import ModelConfig
from .loader import build_model, iterate_checkpoint, weight_target, with_quantization
from .tensor_source import is_fp8, read_all

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


def write_dequantized_checkpoint(model_dir: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """Write to ``out_dir`` the checkpoint of ``model_dir`` as an engine serving it with ``quantization``
    (``"fp8"``: quantized at load; None: the checkpoint's own FP8 layout) computes with in the batch-invariant
    mode: FP8 weights dequantized (float32), no scales, no ``quantization_config``; the other files copied."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = with_quantization(ModelConfig.from_dir(model_dir), quantization)
    if config.quantization is None:
        raise ValueError(f"{model_dir} has no FP8 weights and no quantization was given: the engine computes with "
                         "the checkpoint's own weights, load those")
    model = build_model(config, torch.float32, "meta")
    tensors = {name: read_all(source) for name, source in iterate_checkpoint(model_dir)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        target = weight_target(model, name)
        if target is None or target.param.dtype != FP8_DTYPE:
            out[name] = tensor
            continue
        block = model.get_submodule(target.param_name.rpartition(".")[0]).block
        if is_fp8(tensor):
            module = name.removesuffix("weight")
            scale = tensors.get(module + "weight_scale", tensors.get(module + "weight_scale_inv"))
            if scale is None:
                raise ValueError(f"checkpoint tensor {name!r} is FP8 but has no weight_scale")
            out[name] = dequantize(tensor, _scales(scale.float(), tensor.shape, block), block, torch.float32)
        else:
            out[name] = dequantize(*quantize(tensor, block), block, torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith("model.safetensors") and path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return out_dir


def _scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's scales in ``dequantize``'s layout: per row ``[..., rows, 1]`` (a per-tensor scale spread
    over the rows, as the engine's layers hold it), or per block as they are."""
    if block is not None:
        return scale
    lead, rows = tuple(shape[:-2]), shape[-2]
    if scale.numel() == math.prod(lead):
        return scale.reshape(*lead, 1, 1).expand(*lead, rows, 1)
    return scale.reshape(*lead, rows, 1)
