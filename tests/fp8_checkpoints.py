"""FP8 checkpoints for the tests, written the way users get them.

* :func:`compressed_tensors_checkpoint`: compressed-tensors (PyPI) applies a preset scheme (``FP8``,
  ``FP8_DYNAMIC``, ``FP8_BLOCK``), computes the scales with its own ``calculate_qparams``, compresses
  the weights with its own compressor and writes ``quantization_config``: the library llm-compressor
  drives. llm-compressor itself is not used: its releases pin ``transformers<=5.17`` (this project
  runs 5.23) and pull ``datasets`` and ``auto-round``; and since transformers 5 fuses MoE experts
  into one 3-D parameter that compressed-tensors' ``Linear`` targets miss, the weights are put in a
  module tree of one ``nn.Linear`` per checkpoint projection (the checkpoint's own names), which is
  what llm-compressor's MoE calibration modules do too. Static activation scales (``FP8``) are
  calibrated from transformers' forward pass on random tokens.
* :func:`block_fp8_checkpoint`: the block-wise ``quant_method: "fp8"`` layout of Qwen3-*-FP8 and
  DeepSeek-V3 (``weight_scale_inv`` per ``weight_block_size`` tile), written by hand as those
  checkpoints' conversion scripts do.
* :func:`dequantized_checkpoint`: an FP8 checkpoint's weights as float32 (``megatron_kernels.fp8``'s
  one definition of their value), the model the engine's reference path must equal.
* :func:`edited_checkpoint`: a copy whose tensors a test changed (per-row values, a broken scale).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from megatron_kernels import fp8

# The layers these checkpoints keep unquantized, in compressed-tensors' patterns: the LM head, MoE
# routers and the shared expert's gate, and vision towers (both vision-language layouts).
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*block_sparse_moe\\.gate$",
          "re:(model\\.)?visual.*", "re:(model\\.)?vision_tower.*", "re:(model\\.)?multi_modal_projector.*"]


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, dst / path.name)


def _linear_tree(tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """One ``nn.Linear`` per 2-D projection weight, at its checkpoint name; the other tensors apart."""
    root, rest = nn.Module(), {}
    for name, tensor in tensors.items():
        module_name, _, kind = name.rpartition(".")
        if kind != "weight" or tensor.dim() != 2 or "embed_tokens" in module_name or "norm" in module_name:
            rest[name] = tensor
            continue
        parent = root
        for part in module_name.split("."):
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        linear = nn.Linear(tensor.shape[1], tensor.shape[0], bias=f"{module_name}.bias" in tensors)
        linear.weight.data = tensor.clone()
        if linear.bias is not None:
            linear.bias.data = tensors[f"{module_name}.bias"].clone()
        *path, leaf = module_name.split(".")
        container = root.get_submodule(".".join(path)) if path else root
        setattr(container, leaf, linear)
    bias_names = {f"{n}.bias" for n, m in root.named_modules() if isinstance(m, nn.Linear) and m.bias is not None}
    return root, {k: v for k, v in rest.items() if k not in bias_names}


def _input_amax(model_dir: Path) -> dict[str, float]:
    """Largest input magnitude of every linear layer of transformers' model over random tokens (static scales)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name):
        return lambda module, args: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item()))

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    return amax


def compressed_tensors_checkpoint(src: str | Path, dst: str | Path, preset: str,
                                  block: tuple[int, int] | None = None, ignore: list[str] | None = None) -> Path:
    """``src`` (a float checkpoint) quantized with compressed-tensors' ``preset`` scheme, written to ``dst``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    tree, rest = _linear_tree(load_file(src / "model.safetensors"))
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if block is not None:
        scheme.weights.block_structure = list(block)
        scheme.input_activations.group_size = block[1]
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": scheme},
                                                       ignore=IGNORE if ignore is None else ignore),
                              show_progress=False)
    amax = _input_amax(src) if scheme.input_activations is not None and not scheme.input_activations.dynamic else {}
    for name, module in tree.named_modules():
        args = getattr(module, "quantization_scheme", None)
        if args is None:
            continue
        weight = module.weight.detach().float()
        if args.weights.strategy == "tensor":
            low, high = weight.amin(), weight.amax()
        elif args.weights.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        else:
            bn, bk = args.weights.block_structure
            tiles = weight.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
            low, high = tiles.amin((1, 3)), tiles.amax((1, 3))
        scale, _ = calculate_qparams(low, high, args.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if name in amax:
            value = torch.tensor(amax[name])
            scale, _ = calculate_qparams(-value, value, args.input_activations)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    compressor.remove_decompression_hook(tree)
    save_file({**rest, **{k: v.contiguous() for k, v in tree.state_dict().items()}}, dst / "model.safetensors",
              metadata={"format": "pt"})
    compressor.update_config(str(dst))
    return dst


def block_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int],
                         skip: tuple[str, ...] = ("lm_head", "mlp.gate.", "shared_expert_gate", "visual")) -> Path:
    """``src`` in the block-wise ``quant_method: "fp8"`` layout: e4m3 ``weight`` and float32 ``weight_scale_inv``
    per ``block`` tile for every projection, other tensors as they were."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.removesuffix("weight")
        if (name.endswith("proj.weight") or name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))) \
                and tensor.dim() == 2 and not any(piece in name for piece in skip):
            tensors[name], tensors[module + "weight_scale_inv"] = fp8.quantize(tensor, block)
        else:
            tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _scale_block(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """The scale layout of one checkpoint tensor: per tensor, per row or per block (its size read off the shapes)."""
    rows, columns = weight.shape
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1), None
    if scale.shape[0] == rows and scale.numel() == rows:
        return scale.reshape(rows, 1), None
    return scale, (-(-rows // scale.shape[0]), -(-columns // scale.shape[1]))


def dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """An FP8 checkpoint ``src`` as a float32 one: every FP8 weight times its scales, no quantization_config."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if tensor.dtype == fp8.FP8_DTYPE:
            module = name.removesuffix("weight")
            scale = tensors.get(module + "weight_scale", tensors.get(module + "weight_scale_inv"))
            scale, block = _scale_block(tensor, scale.float())
            out[name] = fp8.dequantize(tensor, scale, block, torch.float32)
        else:
            out[name] = tensor.float()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def edited_checkpoint(src: str | Path, dst: str | Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose tensors ``edit(tensors)`` changed in place."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, dst / "model.safetensors")
    return dst
