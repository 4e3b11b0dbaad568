"""Loading Hugging Face safetensors checkpoints (single file or sharded with an index) into the decoder.

Each tensor is read through a safetensors slice handed to the owning layer's ``weight_loader``,
so a tensor-parallel rank reads only its slice from disk.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .parallel import SINGLE, TensorParallel

# checkpoint projection name -> (fused module name, shard id)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, from its index when sharded."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint index names missing files: {', '.join(missing)}")
    return files


def iterate_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """Yield ``(name, safetensors slice)`` for every tensor, without reading the data yet."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_slice(name)


def _parameter(model: LlamaForCausalLM, module_path: str, param_name: str) -> tuple[torch.nn.Module, torch.nn.Parameter] | None:
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return None
    param = getattr(module, param_name, None)
    return (module, param) if isinstance(param, torch.nn.Parameter) else None


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.nn.Parameter, Callable | None, str | None] | None:
    """Map a checkpoint tensor name to the parameter that holds it (and its loader and shard).

    A module of that exact name wins (a vision tower keeps its own ``q_proj``); otherwise the
    decoder's projections are fused (``q_proj`` -> ``qkv_proj`` shard ``q``).
    """
    if name.endswith(IGNORED_SUFFIXES):
        return None
    module_path, _, param_name = name.rpartition(".")
    found, shard = _parameter(model, module_path, param_name), None
    parts = module_path.split(".")
    if found is None and parts[-1] in FUSED_PROJECTIONS:
        parts[-1], shard = FUSED_PROJECTIONS[parts[-1]]
        found = _parameter(model, ".".join(parts), param_name)
    if found is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
    module, param = found
    return param, getattr(module, "weight_loader", None), shard


def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, object]],
                 progress: Callable[[str], None] | None = None, partial: bool = False) -> None:
    """Copy checkpoint tensors into ``model``; every parameter must be covered exactly (``partial``:
    any subset, e.g. the weights a trainer changed).

    ``progress`` is called with each tensor's name once it is loaded (load progress reporting, and
    what a refit that fails midway reports as replaced).
    """
    expected = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    with torch.no_grad():
        for checkpoint_name, source in tensors:
            name = model.checkpoint_name(checkpoint_name)
            if name is None:
                continue  # held by another rank (a vision tower lives on tensor-parallel rank 0)
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # tied: the embedding already fills it
            target = _target(model, name)
            if target is None:
                continue
            param, loader, shard = target
            try:
                if loader is not None:
                    loader(param, source, shard)
                else:
                    loaded = source if isinstance(source, torch.Tensor) else source[:]
                    if tuple(loaded.shape) != tuple(param.shape):
                        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
                    param.data.copy_(loaded)
            except ValueError as exc:
                raise ValueError(f"weight {name}: {exc}") from None
            seen.add(id(param))
            if progress is not None:
                progress(checkpoint_name)
    missing = [n for pid, n in expected.items() if pid not in seen]
    if missing and not partial:
        raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:8])}")


# Fields that fix every weight's shape: a refit source must agree on all of them.
STRUCTURAL_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm")
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


def verify_checkpoint(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Check that ``model_dir`` holds weights of exactly ``model``'s shapes, reading no tensor data.

    The check runs the real loading path against a shape-only (meta) copy of the model, so it
    accepts exactly what ``load_weights`` would, and refuses with the first mismatch it finds.
    """
    new_config = ModelConfig.from_dir(model_dir)
    for name in STRUCTURAL_FIELDS:
        new, old = getattr(new_config, name), getattr(model.config, name)
        if new != old:
            raise ValueError(f"{model_dir}: {name} is {new!r} but the serving model has {old!r}")

    def shapes_only():
        for name, source in iterate_checkpoint(model_dir):
            if source.get_dtype() not in FLOAT_DTYPES:
                raise ValueError(f"{model_dir}: tensor {name} has dtype {source.get_dtype()}, expected floating point")
            yield name, tuple(source.get_shape())

    verify_shapes(model, shapes_only())


def verify_shapes(model: LlamaForCausalLM, shapes: Iterable[tuple[str, tuple[int, ...]]], partial: bool = False
                  ) -> None:
    """Check that tensors of these names and full (unsharded) shapes load into ``model``, touching nothing.

    The real loading path runs against a shape-only (meta) copy of the model with this rank's
    tensor-parallel layout, so it accepts exactly what :func:`load_weights` would (fused QKV and
    gate-up parts, slices included) and raises ``ValueError`` naming the first tensor that does not
    fit. A name given twice is refused too (the second copy would silently win).
    """
    shadow = build_model(model.config, torch.float32, "meta", model.tp)
    seen: set[str] = set()

    def meta_tensors():
        for name, shape in shapes:
            if name in seen:
                raise ValueError(f"tensor {name!r} is given twice")
            seen.add(name)
            yield name, torch.empty(shape, device="meta")

    load_weights(shadow, meta_tensors(), partial=partial)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """An uninitialised model with parameters allocated directly on ``device`` in ``dtype``."""
    model_class = LlamaForCausalLM
    if config.vision is not None:
        from .vision import VisionLanguageModel as model_class  # noqa: PLC0415 - transformers only when needed
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config, tp=tp, device=device)
    return model.eval()


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
               tp: TensorParallel = SINGLE, progress: Callable[[str], None] | None = None) -> LlamaForCausalLM:
    config = ModelConfig.from_dir(model_dir)
    model = build_model(config, dtype, device, tp)
    load_weights(model, iterate_checkpoint(model_dir), progress)
    return model
