"""Loading Hugging Face safetensors checkpoints (single file or sharded with an index), or a GGUF file's directory
(:mod:`.gguf`), into the decoder.

Each tensor is handed to the owning layer's ``weight_loader``. A model's first load reads each tensor whole
and checks it for NaN and infinities before it is copied in (:mod:`.finite`; a refusal names the
tensor); a refit's verify step checks views of the mapped files (:func:`checkpoint_views`), and its load
step reads through safetensors slices, so a tensor-parallel rank reads only its slice.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from .checkpoint_files import checkpoint_files
from .finite import refuse_nonfinite
from .config import ModelConfig
from .errors import UnsupportedModelError
from .gguf.view import GGUF_SUFFIX, WEIGHTS_LINK
from .llama import LlamaForCausalLM
from .experts.moe import FusedExperts, expert_weight_name
from .parallel import SINGLE, TensorParallel
from .quantization import ONLINE, online_fp8
from .tensor_source import TensorSource, copy_checked, read_all

# checkpoint projection name -> (fused module name, shard id)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Tensors with no weight to load: rotary tables, and a checkpoint's per-tensor FP8 KV scales, as
# compressed-tensors and AutoFP8 name them (the FP8 KV cache keeps its own scale per token and head,
# which needs no calibration).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale", ".kv_scale",
                    "k_proj.output_scale", "v_proj.output_scale")
# block-wise FP8 checkpoints' name of the scale (a multiplier, as compressed-tensors' ``weight_scale``)
SCALE_ALIASES = {"weight_scale_inv": "weight_scale"}


def iterate_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """Yield ``(name, safetensors slice)`` for every tensor, without reading the data yet (a GGUF file's tensors
    come dequantized, each when it is reached)."""
    return _each_tensor(model_dir, whole=False)


def _gguf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from .gguf.tensors import gguf_tensors  # noqa: PLC0415 - the gguf library only where a GGUF file is served

    return gguf_tensors(path)


# safetensors' dtype names -> torch's, for the tensors :func:`checkpoint_views` maps
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                       "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor, each read whole when it is reached (one at a time)."""
    return _each_tensor(model_dir, whole=True)


def _each_tensor(model_dir: str | Path, whole: bool) -> Iterator[tuple[str, Any]]:
    """Each tensor read whole (``whole``) or as a safetensors slice read on demand; a GGUF file's come whole."""
    for path in checkpoint_files(model_dir):
        if path.suffix == GGUF_SUFFIX:
            yield from _gguf_tensors(path)
            continue
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name) if whole else handle.get_slice(name)


def checkpoint_views(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor as a view of its file mapped in memory: nothing is copied (a
    refit's verify step reads each tensor once, for the finite check, and the load step reads it again from the
    page cache). The mapping is private (copy-on-write), so the views are writable and the file never changes."""
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size else None
        for name, entry in header.items():
            dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if name != "__metadata__" else None
            if dtype is None:
                continue  # metadata, or a dtype the shape check (verify_checkpoint) refuses
            begin, end = entry["data_offsets"]
            count = (end - begin) // dtype.itemsize
            if count == 0 or mapped is None:
                yield name, torch.empty(entry["shape"], dtype=dtype)
                continue
            flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + length + begin)
            yield name, flat.view(entry["shape"])


def _parameter(model: LlamaForCausalLM, module_path: str, param_name: str) -> tuple[torch.nn.Module, torch.nn.Parameter] | None:
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return None
    param = getattr(module, param_name, None)
    return (module, param) if isinstance(param, torch.nn.Parameter) else None


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter (by its name in the model), and which of its pieces.

    ``load`` returns the names of sibling parameters of the same module that it filled too (an FP8
    layer given a floating-point weight quantizes it, which fills its scales), or None.
    """

    param_name: str
    param: torch.nn.Parameter
    load: Callable[[TensorSource], Iterable[str] | None]
    pieces: frozenset  # (part, expert) pairs this tensor fills; (None, None) = the whole parameter


def _pieces(module: torch.nn.Module, param_name: str) -> frozenset:
    """Every piece of a parameter that checkpoints fill separately (one, unless the module fuses several)."""
    if hasattr(module, "weight_pieces"):
        return module.weight_pieces(param_name)
    return frozenset({(None, None)})


def _empty_shared_expert(model: LlamaForCausalLM, name: str) -> bool:
    """A Qwen2-MoE shared expert of ``shared_expert_intermediate_size`` 0: transformers still writes it (empty)
    and its gate, whose product is zero, so there is nothing to load."""
    moe = model.config.moe
    return moe is not None and not moe.shared_expert_intermediate_size and ".mlp.shared_expert" in name


def weight_target(model: LlamaForCausalLM, name: str) -> WeightTarget | None:
    """Map a Hugging Face tensor name to the parameter that holds it (None: a tensor with no weight to load, or
    an expert another expert-parallel rank holds).

    Works on names alone, so it serves a loader that reads files and one that receives tensors. A
    module of that exact name wins (a vision tower keeps its own ``q_proj``); otherwise the decoder's
    projections are fused (``q_proj`` -> ``qkv_proj`` part ``q``), and per-expert names go to their
    layer's stacked experts (:func:`.moe.expert_weight_name`).
    """
    if name.endswith(IGNORED_SUFFIXES) or _empty_shared_expert(model, name):
        return None
    module_path, param_name, part, expert = expert_weight_name(name)
    if param_name is None:
        return None  # an FP8 expert's activation scale: experts run weight-only
    param_name = SCALE_ALIASES.get(param_name, param_name)
    found = _parameter(model, module_path, param_name)
    parts = module_path.split(".")
    if found is None and part is None and parts[-1] in FUSED_PROJECTIONS:
        parts[-1], part = FUSED_PROJECTIONS[parts[-1]]
        module_path = ".".join(parts)
        found = _parameter(model, module_path, param_name)
    if found is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
    module, param = found
    if expert is not None and isinstance(module, FusedExperts) and not module.holds(expert):
        return None  # another expert-parallel rank's expert: never read here
    pieces = frozenset(p for p in _pieces(module, param_name)
                       if (part is None or p[0] == part) and (expert is None or p[1] == expert))
    if not pieces:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
    loader = getattr(module, "weight_loader", None)
    if loader is None:
        load = functools.partial(_copy_whole, param)
    elif expert is None:
        load = functools.partial(loader, param, shard=part) if part is not None else functools.partial(loader, param)
    else:
        load = functools.partial(loader, param, part=part, expert=expert)
    return WeightTarget(f"{module_path}.{param_name}", param, load, pieces)


def _copy_whole(param: torch.nn.Parameter, source: TensorSource) -> None:
    copy_checked(param, read_all(source))


def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, TensorSource]],
                 progress: Callable[[str], None] | None = None, partial: bool = False,
                 finite_as: str | None = None) -> None:
    """Copy checkpoint tensors into ``model``; every piece of every parameter must be covered (``partial``:
    any subset, e.g. the weights a trainer changed).

    ``tensors`` yields ``(Hugging Face name, safetensors slice or tensor)``. ``progress`` is called
    with each tensor's name once it is loaded (load progress reporting, and what a refit that fails
    midway reports as replaced). ``finite_as`` (a model's first load: what the refusal calls the source): each
    tensor this rank loads is read whole and checked for NaN and infinities first; a rank reads only the tensors
    it holds (not another rank's experts or another stage's layers).
    """
    missing: dict[str, set] = {}
    owners = {id(p): n for n, p in model.named_parameters()}  # a tied parameter counts once, by its first name
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if owners[id(param)] == full:
                missing[full] = set(_pieces(module, param_name))
    with torch.no_grad():
        for checkpoint_name, source in tensors:
            name = model.checkpoint_name(checkpoint_name)
            if name is None:
                continue  # held by another rank (a vision tower lives on tensor-parallel rank 0)
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # tied: the embedding already fills it
            target = weight_target(model, name)
            if target is None:
                continue
            if finite_as is not None:
                if not isinstance(source, torch.Tensor):
                    source = source[:]  # read once: the check and the copy share it
                refuse_nonfinite(((checkpoint_name, source),), finite_as)
            try:
                siblings = target.load(source) or ()
            except ValueError as exc:
                raise ValueError(f"weight {name}: {exc}") from None
            module_path = target.param_name.rpartition(".")[0]
            for filled in (target.param_name, *(f"{module_path}.{sibling}" for sibling in siblings)):
                if filled in missing:
                    missing[filled] -= target.pieces
            if progress is not None:
                progress(checkpoint_name)
    gaps = sorted(_describe(name, pieces) for name, pieces in missing.items() if pieces)
    if gaps and not partial:
        raise ValueError(f"checkpoint is missing weights: {', '.join(gaps[:8])}")


def _describe(param_name: str, pieces: set) -> str:
    parts = sorted(f"{part}" + ("" if expert is None else f" of expert {expert}")
                   for part, expert in pieces if part is not None)
    return param_name if not parts else f"{param_name} ({', '.join(parts[:4])}{', ...' if len(parts) > 4 else ''})"


# Fields that fix every weight's shape: a refit source must agree on all of them.
STRUCTURAL_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm", "moe")
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}  # FP8 data, with scales beside it


def verify_checkpoint(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Check that ``model_dir`` holds weights of exactly ``model``'s shapes, reading no tensor data.

    The check runs the real loading path against a shape-only (meta) copy of the model, so it
    accepts exactly what ``load_weights`` would, and refuses with the first mismatch it finds.
    """
    if (Path(model_dir) / WEIGHTS_LINK).exists():
        raise ValueError(f"{model_dir}: new weights come as a safetensors checkpoint; a GGUF file is served from "
                         "the start only")
    if (Path(model_dir) / "config.json").is_file():  # else weights only (prime-rl's steps): the serving model's
        new_config = ModelConfig.from_dir(model_dir)
        for name in STRUCTURAL_FIELDS:
            new, old = getattr(new_config, name), getattr(model.config, name)
            if new != old:
                raise ValueError(f"{model_dir}: {name} is {new!r} but the serving model has {old!r}")

    dtypes: dict[str, torch.dtype] = {}

    def shapes_only():
        for name, source in iterate_checkpoint(model_dir):
            dtype = source.get_dtype()
            if dtype not in FLOAT_DTYPES and dtype not in FP8_DTYPES:
                raise ValueError(f"{model_dir}: tensor {name} has dtype {dtype}, expected floating point")
            if dtype in FP8_DTYPES:
                dtypes[name] = FP8_DTYPES[dtype]
            yield name, tuple(source.get_shape())

    verify_shapes(model, shapes_only(), dtypes=dtypes)


def verify_shapes(model: LlamaForCausalLM, shapes: Iterable[tuple[str, tuple[int, ...]]], partial: bool = False,
                  dtypes: dict[str, torch.dtype] | None = None) -> None:
    """Check that tensors of these names and full (unsharded) shapes load into ``model``, touching nothing.

    The real loading path runs against a shape-only (meta) copy of the model with this rank's
    tensor-parallel layout, so it accepts exactly what :func:`load_weights` would (fused QKV and
    gate-up parts, slices included) and raises ``ValueError`` naming the first tensor that does not
    fit. A name given twice is refused too (the second copy would silently win). ``dtypes``: tensors
    that are not float32 (FP8 data, filled by name when read: floating-point weights of FP8 layers
    are quantized on arrival and need no scales, FP8 ones do).
    """
    shadow = build_model(model.config, torch.float32, "meta", model.tp)
    seen: set[str] = set()

    def meta_tensors():
        for name, shape in shapes:
            if name in seen:
                raise ValueError(f"tensor {name!r} is given twice")
            seen.add(name)
            yield name, torch.empty(shape, device="meta", dtype=(dtypes or {}).get(name, torch.float32))

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
        from .vision.towers import VisionLanguageModel as model_class  # noqa: PLC0415 - transformers only when needed
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config, tp=tp, device=device)
    return model.eval()


def with_quantization(config: ModelConfig, quantization: str | None) -> ModelConfig:
    """The model's FP8 layout once ``--quantization`` is applied: ``fp8`` quantizes a bf16 checkpoint at load;
    a checkpoint that is FP8 already keeps its own layout."""
    if quantization is None or config.quantization is not None:
        return config
    if quantization != ONLINE:
        raise UnsupportedModelError(f"quantization {quantization!r} is not supported: expected {ONLINE!r}")
    return replace(config, quantization=online_fp8())


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
               tp: TensorParallel = SINGLE, progress: Callable[[str], None] | None = None,
               quantization: str | None = None) -> LlamaForCausalLM:
    """Build the model of ``model_dir`` and load its weights; ``quantization="fp8"`` as :func:`with_quantization`."""
    config = with_quantization(ModelConfig.from_dir(model_dir), quantization)
    model = build_model(config, dtype, device, tp)
    load_weights(model, iterate_checkpoint(model_dir), progress, finite_as=f"the checkpoint at {model_dir}")
    return model
