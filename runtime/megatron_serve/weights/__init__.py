"""Weights straight from a trainer: :class:`WeightSender` (over a collective) and the refit sources.

See :mod:`.sender` for the trainer's side, :mod:`.sources` for the engine's, :mod:`.manifest` for
what travels and :mod:`.group` for the process group they share.
"""

from .sender import DEFAULT_BUCKET_BYTES, WeightSender, WeightTransferError

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightSender", "WeightTransferError"]
