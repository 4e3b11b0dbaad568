"""Hot-path kernels of megatron-serve: Triton implementations with plain-PyTorch references."""

from .ops import OP_NAMES, backend_for, get_op

__all__ = ["OP_NAMES", "backend_for", "get_op"]
