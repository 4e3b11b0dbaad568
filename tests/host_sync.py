"""A CPU stand-in for CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode("error")``): code run under
:class:`NoHostSync` raises where it reads a tensor's value on the host or makes a shape from values, what a CUDA
graph capture forbids (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``, ``nonzero``, boolean-mask indexing,
``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``...)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_METHODS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "unique",
            "unique_consecutive", "bincount", "masked_select", "argwhere", "numpy"}
_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
        "aten::bincount"}


class HostSync(RuntimeError):
    """Raised where the guarded code would synchronize with the device."""


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _METHODS or (name == "repeat_interleave" and "output_size" not in kwargs
                                and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            raise HostSync(f"{name} reads values on the host")
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No: torch wraps a mode's ``__torch_dispatch__`` to keep Dynamo out of it otherwise, and that wrapper
        imports ``torch._dynamo`` at its first call (about 2 s of CPU in every process that guards a step; nothing
        here is compiled)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in _OPS:
            raise HostSync(f"{func._schema.name} makes a shape from values")
        if func._schema.name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None):
            raise HostSync(f"{func._schema.name} with a boolean mask makes a shape from values")
        return func(*args, **kwargs)


class NoHostSync:
    """``with NoHostSync(): ...`` raises :class:`HostSync` at the first host synchronization inside."""

    def __enter__(self) -> "NoHostSync":
        self._modes = [_Functions(), _Ops()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
