"""Weights straight from a trainer, the engine's side and what both sides share.

:mod:`.sources` is what an engine loads a refit from, :mod:`.manifest` what travels and :mod:`.group`
the process group both sides join. The trainer's side, ``WeightSender``, runs in the caller's process
beside its ``InferenceClient`` (:mod:`megatron_serve.client.weight_sender`; ``megatron_serve.WeightSender``),
so importing this package (the engine does) never imports the client.
"""
