"""Which layers hold FP8 weights, and how: ``config.json``'s ``quantization_config`` or ``--quantization fp8``.

Two checkpoint formats are read, the two FP8 formats users download:

* **compressed-tensors** (what llm-compressor writes; ``quant_method: "compressed-tensors"``, format
  ``float-quantized``): ``config_groups`` of 8-bit float weights with per-tensor, per-channel or
  block scales (``weight_scale``) and static (``input_scale``) or dynamic per-token/per-group
  activations (the ``FP8``, ``FP8_DYNAMIC`` and ``FP8_BLOCK`` schemes); ``targets``/``ignore`` pick
  the layers, as compressed-tensors matches them (``re:`` regexes with ``re.match``, exact names,
  or the class name ``Linear``).
* **block-wise fp8** (``quant_method: "fp8"``, Qwen3-*-FP8, DeepSeek-V3): ``weight_block_size``
  tiles with ``weight_scale_inv`` (a multiplier, despite its name), dynamic activations; without
  ``weight_block_size`` the older per-tensor form (``weight_scale``, ``activation_scheme``).
  ``modules_to_not_convert`` / ``ignored_layers`` name what stays unquantized (substrings, as
  transformers reads them).

``--quantization fp8`` (vLLM's option) quantizes a bf16 checkpoint's decoder linears at load: one
scale per output row, activations per token at run time. Everything else (INT4, INT8, NVFP4, MXFP4,
AWQ, GPTQ...) is refused here with the scheme's name: serving a format we do not implement would
mean serving wrong tokens. Only decoder linear layers (attention and MLP projections, experts,
shared experts) are quantized; embeddings, the LM head, MoE routers and vision towers stay in the
model dtype, and a checkpoint whose tensor for one of those is FP8 is refused when it loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import UnsupportedModelError

ONLINE = "fp8"  # the --quantization value


@dataclass(frozen=True)
class Fp8Scheme:
    """How one linear layer's FP8 weights are stored.

    ``block``: ``(rows, columns)`` of one weight scale, or None for one scale per output row (a
    checkpoint's per-tensor scale is spread over its rows). ``static_input_scale``: the checkpoint
    carries a calibrated per-tensor activation scale (``input_scale``) that FP8 x FP8 GEMMs use
    instead of per-token scales.
    """

    block: tuple[int, int] | None = None
    static_input_scale: bool = False


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    scheme: Fp8Scheme


@dataclass(frozen=True)
class QuantizationConfig:
    """The FP8 layout of a model: which decoder linears are FP8 (``scheme_for``) and with what scheme.

    ``method``: ``compressed-tensors``, ``fp8`` (a checkpoint's), or ``fp8-online`` (``--quantization
    fp8``: the checkpoint is bf16 and every decoder linear is quantized at load).
    """

    method: str
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...] = ()
    substring_ignore: bool = False  # quant_method fp8 lists module name pieces, compressed-tensors patterns

    def scheme_for(self, module: str) -> Fp8Scheme | None:
        """The scheme of the linear layer with Hugging Face name ``module`` (None: it stays unquantized).

        ``module`` is the decoder's name (``model.layers.3.self_attn.q_proj``); the two layouts of
        vision-language checkpoints (``model.language_model.layers...``, ``language_model.model.layers...``)
        are tried too, so rules written against either match.
        """
        names = _candidate_names(module)
        if any(self._ignored(name) for name in names):
            return None
        for group in self.groups:
            if any(_matches(name, target) for name in names for target in group.targets):
                return group.scheme
        return None

    def _ignored(self, name: str) -> bool:
        if self.substring_ignore:
            return any(piece in name for piece in self.ignore)
        return any(_matches(name, pattern) for pattern in self.ignore)

    def fused_scheme(self, prefix: str, parts: tuple[str, ...]) -> Fp8Scheme | None:
        """The one scheme of the checkpoint projections ``prefix.part`` that one fused layer holds (q, k and
        v; gate and up; every expert's): they must agree, since they share one weight here."""
        schemes = {part: self.scheme_for(f"{prefix}.{part}") for part in parts}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            described = ", ".join(f"{part}: {_describe(s)}" for part, s in schemes.items())
            raise UnsupportedModelError(f"{prefix}: the projections fused into one layer are quantized differently "
                                        f"({described}); they must share one FP8 scheme")
        return distinct.pop()


def online_fp8() -> QuantizationConfig:
    """``--quantization fp8``: every decoder linear, one scale per output row, activations per token."""
    return QuantizationConfig("fp8-online", (_Group(("Linear",), Fp8Scheme()),))


def parse_quantization(raw: dict[str, Any] | None) -> QuantizationConfig | None:
    """``config.json``'s ``quantization_config`` (None: an unquantized checkpoint)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fp8":
        return _fp8_method(raw)
    raise UnsupportedModelError(f"quantization method {method!r} is not supported: this engine serves FP8 "
                                "checkpoints (compressed-tensors float-quantized, or quant_method 'fp8')")


def _describe(scheme: Fp8Scheme | None) -> str:
    if scheme is None:
        return "unquantized"
    granularity = "per-row" if scheme.block is None else f"{scheme.block[0]}x{scheme.block[1]} blocks"
    return f"FP8 {granularity}{', static activations' if scheme.static_input_scale else ''}"


def _scheme_name(args: dict[str, Any]) -> str:
    """A reader's name for a compressed-tensors weight scheme we refuse."""
    bits, kind, group = args.get("num_bits"), args.get("type"), args.get("group_size")
    known = {(4, "float", 16): "NVFP4", (4, "float", 32): "MXFP4", (8, "float", 32): "MXFP8"}
    if (bits, kind, group) in known:
        return known[(bits, kind, group)]
    if kind == "int":
        return f"INT{bits}"
    return f"{bits}-bit {kind}"


def _compressed_tensors(raw: dict[str, Any]) -> QuantizationConfig:
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedModelError("compressed-tensors quantization_config has no config_groups")
    top_format = raw.get("format")
    parsed = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise UnsupportedModelError(f"compressed-tensors config group {name!r} is not an object")
        weights = group.get("weights") or {}
        fmt = group.get("format") or top_format
        scheme_label = f"compressed-tensors group {name!r} ({_scheme_name(weights)} weights, format {fmt!r})"
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise UnsupportedModelError(f"unsupported quantization scheme {_scheme_name(weights)}: {scheme_label}; "
                                        "this engine serves FP8 (8-bit float) weights only")
        if fmt not in ("float-quantized", None):
            raise UnsupportedModelError(f"unsupported compressed-tensors format {fmt!r} in {scheme_label}: FP8 "
                                        "weights must be stored float-quantized")
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise UnsupportedModelError(f"unsupported FP8 weights in {scheme_label}: they must be static and "
                                        "symmetric")
        strategy = weights.get("strategy")
        if strategy in ("tensor", "channel"):
            block = None
        elif strategy == "block":
            block = _block(weights.get("block_structure"), scheme_label)
        else:
            raise UnsupportedModelError(f"unsupported FP8 weight strategy {strategy!r} in {scheme_label}: "
                                        "expected tensor, channel or block")
        static = _activations(group.get("input_activations"), block, scheme_label)
        if group.get("output_activations"):
            raise UnsupportedModelError(f"output activation quantization in {scheme_label} is not supported")
        targets = tuple(group.get("targets") or ())
        parsed.append(_Group(targets, Fp8Scheme(block, static)))
    _check_kv_scheme(raw.get("kv_cache_scheme"))
    return QuantizationConfig("compressed-tensors", tuple(parsed), tuple(raw.get("ignore") or ()))


def _activations(args: dict[str, Any] | None, block: tuple[int, int] | None, label: str) -> bool:
    """Whether activations have a static (calibrated) scale; refuses what FP8 GEMMs cannot run."""
    if not args:
        return False  # weight-only checkpoints: activations are quantized per token where GEMMs need FP8
    if args.get("num_bits") != 8 or args.get("type") != "float" or not args.get("symmetric", True):
        raise UnsupportedModelError(f"unsupported activation quantization ({_scheme_name(args)}) in {label}")
    strategy, dynamic = args.get("strategy"), bool(args.get("dynamic"))
    if not dynamic:
        if strategy != "tensor" or block is not None:
            raise UnsupportedModelError(f"static {strategy} activation scales in {label} are not supported: "
                                        "static scales are per tensor, with per-row weight scales")
        return True
    if strategy == "group" and (block is None or args.get("group_size") != block[1]):
        raise UnsupportedModelError(f"dynamic activation groups of {args.get('group_size')} in {label} must match "
                                    "the weight blocks' columns")
    if strategy not in ("token", "tensor", "group"):
        raise UnsupportedModelError(f"unsupported dynamic activation strategy {strategy!r} in {label}")
    return False


def _check_kv_scheme(args: dict[str, Any] | None) -> None:
    """A checkpoint's KV-cache scheme: FP8 ones load (their per-tensor scales go unused: the FP8 cache keeps
    a scale per token and head), others are refused."""
    if args and (args.get("num_bits") != 8 or args.get("type") != "float"):
        raise UnsupportedModelError(f"unsupported kv_cache_scheme ({_scheme_name(args)}): only FP8 KV caches")


def _block(value: Any, label: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise UnsupportedModelError(f"weight block size {value!r} in {label}: want two positive integers")
    return int(value[0]), int(value[1])


def _fp8_method(raw: dict[str, Any]) -> QuantizationConfig:
    label = "quant_method 'fp8'"
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"unsupported FP8 format {fmt!r} in {label}: only e4m3 weights")
    activation = raw.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise UnsupportedModelError(f"unsupported activation_scheme {activation!r} in {label}")
    block = raw.get("weight_block_size")
    if block is not None:
        block = _block(block, label)
        if activation == "static":
            raise UnsupportedModelError(f"static activation scales with weight_block_size in {label} are not "
                                        "supported (block-wise checkpoints quantize activations dynamically)")
    ignore = tuple(raw.get("modules_to_not_convert") or ()) + tuple(raw.get("ignored_layers") or ())
    scheme = Fp8Scheme(block, activation == "static")
    return QuantizationConfig("fp8", (_Group(("Linear",), scheme),), ignore, substring_ignore=True)


_VLM_LAYOUTS = ("model.language_model.", "language_model.model.")


def _candidate_names(module: str) -> tuple[str, ...]:
    if not module.startswith("model."):
        return (module,)
    rest = module.removeprefix("model.")
    return (module, *(prefix + rest for prefix in _VLM_LAYOUTS))


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` is ``re.match``; ``Linear`` (a class name) matches every linear
    layer asked about here; anything else is an exact module name."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == "Linear" or target == name
