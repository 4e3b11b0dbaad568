"""A checkpoint tensor as a weight loader receives it, and the reads every loader makes of it.

Every layer that fills its parameters from a checkpoint (the linears, the experts, their FP8 twins, the loader's
whole-tensor copies) reads its rank's slice the same way, checks the full size of the split dimension and copies with
the same checks; they live here, beneath all of them, so that none of the layer modules imports another for them.
"""

from __future__ import annotations

import torch

#: A checkpoint tensor handed to a loader: a safetensors slice (``get_shape``, ``get_dtype``, indexing) or a tensor.
TensorSource = object


def shape_of(source: TensorSource) -> tuple[int, ...]:
    """The full shape of a checkpoint tensor, read without reading its data."""
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def narrow(source: TensorSource, dim: int, start: int, length: int) -> torch.Tensor:
    """Read ``[start, start+length)`` along ``dim`` (only that slice of a safetensors file is read)."""
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, length)
    index = [slice(None)] * len(source.get_shape())
    index[dim] = slice(start, start + length)
    return source[tuple(index)]


def read_all(source: TensorSource) -> torch.Tensor:
    """The whole tensor."""
    return source if isinstance(source, torch.Tensor) else source[:]


def check_full(source: TensorSource, dim: int, size: int) -> None:
    """A rank reads only its slice, so the full size of the split dimension is checked here: a larger
    tensor would otherwise give a slice that fits."""
    shape = shape_of(source)
    if len(shape) <= dim or shape[dim] != size:
        raise ValueError(f"shape {shape} does not fit: dimension {dim} must be {size}")


def is_fp8(source: TensorSource) -> bool:
    """Whether a checkpoint tensor holds e4m3 data (its values mean nothing without their scales)."""
    if isinstance(source, torch.Tensor):
        return source.dtype == torch.float8_e4m3fn
    return source.get_dtype() == "F8_E4M3"


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param``, refusing a shape that differs and FP8 data on either side alone (a refusal
    the loader prefixes with the tensor's name)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    if is_fp8(loaded) != is_fp8(param):
        raise ValueError("is FP8 but this layer is not quantized (its quantization_config leaves it in the model "
                         "dtype)" if is_fp8(loaded) else f"has dtype {loaded.dtype} where FP8 data is expected")
    with torch.no_grad():  # through the parameter, not .data: its version counter moves, so kept copies see it
        param.copy_(loaded)
