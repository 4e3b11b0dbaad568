"""Trainer side of ``--batch-invariant``: compute log probs with the engine's arithmetic, bit for bit.

It needs ``torch`` (and ``transformers`` for its models), not the server's dependencies: the trainer-only
distribution ``megatron-serve-invariant`` ships this package alone; with the full ``megatron-serve`` the
same names are ``megatron_serve.invariant``. A trainer gets:

* :func:`batch_invariant`, a context manager under which ``nn.Linear``, SiLU and the rotary
  embedding's ``cos``/``sin`` use the engine's batch-invariant ops (:mod:`megatron_kernels.invariant`);
* the attention implementation ``"megatron_invariant"``, registered with ``transformers`` on import
  when ``transformers`` is installed: keys reduced in fixed blocks from position 0, the engine's
  attention for prefill, decode and prefix-cache hits alike (on CUDA the engine's Triton kernel,
  ``triton_invariant_attention.dense_attention``, which needs ``triton``), over right-padded, left-padded
  and packed batches (:mod:`.invariant_layout`);
* :func:`use_invariant_norms`, which routes a model's RMSNorm modules through the engine's RMSNorm:
  the same bits as ``transformers``' own on CPU, the engine's one-row-per-program Triton kernel on a
  GPU (where PyTorch's reductions pick their split by the row count, and the engine does not use them);
* :func:`use_invariant_lora` (PEFT adapters through the engine's LoRA arithmetic) and
  :func:`replay_routing` (MoE routers take the experts the engine chose).

A ``transformers`` Llama-family or Qwen3 model loaded from the engine's checkpoint in the same dtype
with ``attn_implementation="megatron_invariant"`` and run under ``batch_invariant()`` over prompt +
completion gives, with ``torch.log_softmax(logits.float(), -1)``, exactly the log prob the engine
reported for each completion token (docs/batch-invariance.md).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch

from .invariant import InvariantMode, rms_norm
from .invariant_attention import DensePlan, attention, plan_dense
from .invariant_lora import lora_expand, lora_shrink
from .invariant_layout import BatchLayout, batch_layout
from .reference_lora import LoraBatch, slot_table

ATTENTION_NAME = "megatron_invariant"

__all__ = ["ATTENTION_NAME", "batch_invariant", "hf_attention", "replay_routing", "use_invariant_lora",
           "use_invariant_norms"]


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run this process's forward passes with the engine's batch-invariant op set. A model that cannot give
    the engine's bits is refused at its forward, with what to do: one cast after loading (its rotary
    embedding's ``inv_freq`` rounded to the cast's dtype, where the engine and a model loaded in that dtype
    keep float32)."""
    hook = torch.nn.modules.module.register_module_forward_pre_hook(_prepare_module)
    try:
        with InvariantMode():
            yield
    finally:
        hook.remove()


def _prepare_module(module: torch.nn.Module, args: tuple) -> None:
    _refuse_rounded_rotary(module)
    _recompute_in_the_mode(module)


def _refuse_rounded_rotary(module: torch.nn.Module) -> None:
    inv_freq = module._buffers.get("inv_freq")
    if inv_freq is not None and inv_freq.dtype != torch.float32:
        raise ValueError(
            f"{type(module).__name__}.inv_freq is {inv_freq.dtype}, but the engine computes rotary angles from "
            "float32 frequencies: the model was cast after loading (model.to(dtype) casts every buffer); load it "
            "in the engine's dtype instead, from_pretrained(..., dtype=...), which keeps inv_freq in float32")


def _recompute_in_the_mode(module: torch.nn.Module) -> None:
    """A ``transformers`` layer under gradient checkpointing recomputes its forward in the backward pass, where
    the autograd engine runs without this thread's torch-function modes: its checkpoint function is wrapped
    once so that a forward run in the mode is recomputed in it (the same saved tensors, the same gradients)."""
    checkpoint = module.__dict__.get("_gradient_checkpointing_func")
    if checkpoint is not None and not isinstance(checkpoint, _ModeCheckpoint):
        module._gradient_checkpointing_func = _ModeCheckpoint(checkpoint)


def _in_the_mode() -> bool:
    return any(isinstance(mode, InvariantMode) for mode in torch.overrides._get_current_function_mode_stack())


class _ModeCheckpoint:
    """A checkpoint function whose recompute runs in :class:`InvariantMode` when its forward did."""

    def __init__(self, checkpoint: Callable) -> None:
        self.checkpoint = checkpoint

    def __call__(self, function: Callable, *args, **kwargs):
        if not _in_the_mode():
            return self.checkpoint(function, *args, **kwargs)

        def in_the_mode(*inner, **inner_kwargs):
            if _in_the_mode():  # the forward itself
                return function(*inner, **inner_kwargs)
            with InvariantMode():  # the recompute, from the backward pass
                return function(*inner, **inner_kwargs)
        return self.checkpoint(in_the_mode, *args, **kwargs)


def use_invariant_norms(model: torch.nn.Module) -> int:
    """Route every RMSNorm module of a ``transformers`` model (a module named ``...RMSNorm`` with
    ``variance_epsilon``) through the engine's RMSNorm; returns how many. Needed for parity on a GPU."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = functools.partial(_invariant_norm, module)
            count += 1
    return count


def _invariant_norm(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def use_invariant_lora(model: torch.nn.Module, max_lora_rank: int) -> int:
    """Route every PEFT LoRA linear of ``model`` through the engine's LoRA arithmetic; returns how many.

    The engine adds an adapter's delta row by row (:mod:`megatron_kernels.invariant_lora`: each rank's
    products summed over the inputs, then each output's over ``max_lora_rank`` ranks, the adapter's own
    padded with zeros, ``B`` scaled before, in the model dtype), reading its slot tables along their strides
    (``reference_lora.slot_table``; a fused projection's ``A`` stacked over its parts); PEFT multiplies by
    GEMMs in float32 and scales after, which rounds otherwise. This builds the engine's tables for each call
    and runs the engine's kernels. ``max_lora_rank``: the engine's ``--max-lora-rank``. Differentiable: the
    adapter trains through it."""
    count = 0
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and isinstance(
                getattr(module, "base_layer", None), torch.nn.Linear):
            module.forward = functools.partial(_invariant_lora, module, max_lora_rank, name.rpartition(".")[2])
            count += 1
    return count


# the engine fuses these projections, and stacks their LoRA A along the rank: (part index, parts)
_FUSED_PARTS = {"q_proj": (0, 3), "k_proj": (1, 3), "v_proj": (2, 3), "gate_proj": (0, 2), "up_proj": (1, 2)}


def _invariant_lora(module: torch.nn.Module, max_rank: int, projection: str, x: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
    result = module.base_layer(x, *args, **kwargs)
    if module.disable_adapters or module.merged:
        return result
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if module.lora_variant.get(name) is not None:
            raise ValueError(f"adapter {name!r} is a LoRA variant (DoRA...): the engine serves plain LoRA")
        dropout = module.lora_dropout[name]
        if module.training and isinstance(dropout, torch.nn.Dropout) and dropout.p:
            raise ValueError(f"adapter {name!r} has lora_dropout {dropout.p}: the engine has none; set it to 0")
        result = _engine_lora_delta(module, name, max_rank, projection, x, result)
    return result


def _engine_lora_delta(module: torch.nn.Module, name: str, max_rank: int, projection: str, x: torch.Tensor,
                       result: torch.Tensor) -> torch.Tensor:
    """``result`` plus the adapter's delta as the engine's slot tables compute it: ``A`` in its part's ranks of
    the fused projection's table, ``B * scaling`` in its own, both in the kernels' layout and the model dtype."""
    a, b = module.lora_A[name].weight, module.lora_B[name].weight
    rank = a.shape[0]
    if rank > max_rank:
        raise ValueError(f"adapter {name!r} has rank {rank}, more than max_lora_rank {max_rank}")
    part, parts = _FUSED_PARTS.get(projection, (0, 1))
    shrink_table = slot_table(1, parts * max_rank, a.shape[1], x.device, x.dtype)
    shrink_table[0, part * max_rank : part * max_rank + rank] = a.to(x.dtype)
    expand_table = slot_table(1, b.shape[0], max_rank, x.device, x.dtype)
    expand_table[0, :, :rank] = (b * module.scaling[name]).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    batch = LoraBatch.of_padded(torch.zeros(rows.shape[0], dtype=torch.int64, device=x.device))
    shrunk = lora_shrink(rows, shrink_table, batch)
    out = result.reshape(-1, result.shape[-1]).clone()  # lora_expand adds in place: not into the base output
    lora_expand(out, shrunk[:, part * max_rank : (part + 1) * max_rank], expand_table, batch)
    return out.view(result.shape)


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, indices: torch.Tensor) -> Iterator[None]:
    """Route the tokens of the forwards run inside to the experts the engine chose (routing replay).

    ``indices`` ``[tokens, moe_layers, top_k]``: for each token of the call, flattened row-major
    (``batch * length``), the experts of each MoE layer, as the engine reports them
    (``return_routing_indices``: a sequence's rows in its tokens' places; padding rows any experts). Each
    ``transformers`` router (a ``...TopKRouter``) takes these instead of its own top-k and weighs them with
    its own probabilities, so a trainer whose router has moved since the rollout still trains the experts
    the rollout used; with the engine's weights the log probs are unchanged (the same experts, the same
    order)."""
    routers = [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]
    if len(routers) != indices.shape[1]:
        raise ValueError(f"routing for {indices.shape[1]} MoE layers, but the model has {len(routers)} routers")
    saved = [router.__dict__.get("forward") for router in routers]
    for layer, router in enumerate(routers):
        router.forward = functools.partial(_replayed_router, router, indices[:, layer])
    try:
        yield
    finally:
        for router, forward in zip(routers, saved):
            if forward is None:
                del router.forward
            else:
                router.forward = forward


def _replayed_router(router: torch.nn.Module, chosen: torch.Tensor, hidden_states: torch.Tensor):
    with _ReplayedTopK(chosen.to(hidden_states.device)):
        return type(router).forward(router, hidden_states)


class _ReplayedTopK(torch.overrides.TorchFunctionMode):
    """``torch.topk`` over a router's ``[tokens, experts]`` scores: the replayed experts and their scores."""

    def __init__(self, chosen: torch.Tensor) -> None:
        super().__init__()
        self.chosen = chosen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk:
            scores = args[0]
            if scores.shape[0] != self.chosen.shape[0]:
                raise ValueError(f"routing replay holds {self.chosen.shape[0]} tokens, the forward {scores.shape[0]}")
            chosen = self.chosen.long()
            return torch.return_types.topk((scores.gather(-1, chosen), chosen))
        return func(*args, **kwargs)


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 position_ids: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention interface over the engine's attention (``megatron_invariant``).

    ``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, L, D]``, causal. Over a whole batch (``S == L``,
    a trainer's forward) each row may hold padding on either side (the 2D ``attention_mask``, passed as-is:
    this name shares flash-attention's mask function) and several packed sequences (``position_ids``
    restarting at 0, or ``cu_seq_lens_q``): :func:`~megatron_kernels.invariant_layout.batch_layout` finds each
    token's sequence, and every sequence attends over its own keys from its position 0, as the engine's
    request does. With a cache (``S < L``, generation) each row is one sequence, the queries its last ``S``
    tokens.
    """
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} attention has no dropout (got {dropout}): run the model in eval "
                         "mode or with attention_dropout=0")
    if torch.is_autocast_enabled(query.device.type):
        raise RuntimeError(f"{ATTENTION_NAME} under torch.autocast: autocast computes in another dtype than the "
                           "engine (float32 norms and residuals around bfloat16 GEMMs); load the model in the "
                           "engine's dtype (from_pretrained(..., dtype=...)) and run without autocast")
    batch, heads, length, dim = query.shape
    keys_length = key.shape[2]
    scale = scaling if scaling is not None else dim**-0.5

    def plan() -> tuple[BatchLayout, DensePlan | None]:
        if length == keys_length:
            layout = batch_layout(batch, length, attention_mask, position_ids, cu_seq_lens_q, query.device)
        else:
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError(f"{ATTENTION_NAME} attention over a cache takes right-padded rows only (the mask "
                                 "has padding): run the trainer's forward over whole sequences, without a cache")
            layout = _cached_layout(batch, length, keys_length, query.device)
        if query.is_cuda:
            return layout, None
        count, longest = layout.keys.shape
        return layout, plan_dense(layout.sequence, layout.positions, count, longest, heads // key.shape[1],
                                  query.device)

    layout, dense_plan = _LAST_PLAN.get((attention_mask, position_ids, cu_seq_lens_q),
                                        (batch, length, keys_length, heads, key.shape[1], query.device), plan)
    rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
    if query.is_cuda:  # the engine's Triton kernel over a paged view of this K/V: the engine's bits on this GPU
        from .triton_invariant_attention import dense_attention  # noqa: PLC0415 - needs triton
        keys, values = (_sequences(cache, layout).transpose(0, 1) for cache in (key, value))
        out = dense_attention(rows, keys, values, layout.sequence, layout.positions, scale)
    else:
        keys, values = (_sequences(cache, layout) for cache in (key, value))
        out = attention(rows, keys, values, layout.sequence, layout.positions, scale, dense_plan)
    return out.view(batch, length, heads, dim), None


class _LastPlan:
    """The last call's layout and attention plan, for the next layers of the same forward (each layer passes
    the same mask and position tensors; planning is Python work over every token). Reused only for equal
    inputs: copies of the last ones are held and compared by value (a few thousand integers, against a plan's
    milliseconds), so another batch, or these tensors changed in place, plan anew."""

    def __init__(self) -> None:
        self._inputs: tuple[torch.Tensor | None, ...] = ()
        self._shape: tuple = ()
        self._value: tuple[BatchLayout, DensePlan | None] | None = None

    def get(self, inputs: tuple[torch.Tensor | None, ...], shape: tuple, make: Callable[[], tuple]) -> tuple:
        if self._value is None or shape != self._shape or not all(
                (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                              and a.device == b.device and torch.equal(a, b))
                for a, b in zip(inputs, self._inputs)):
            value = make()
            self._inputs = tuple(None if t is None else t.detach().clone() for t in inputs)
            self._shape, self._value = shape, value
        return self._value


_LAST_PLAN = _LastPlan()


def _cached_layout(batch: int, length: int, keys_length: int, device: torch.device) -> BatchLayout:
    """One sequence per row, its queries the last ``length`` of its ``keys_length`` tokens."""
    sequence = torch.arange(batch, device=device).repeat_interleave(length)
    positions = (torch.arange(length, device=device) + keys_length - length).repeat(batch)
    keys = torch.arange(batch * keys_length, device=device).view(batch, keys_length)
    return BatchLayout(sequence, positions, keys)


def _sequences(cache: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """``[B, Hkv, L, D]`` to ``[Hkv, sequences, longest, D]``: each sequence's keys (or values) in order."""
    batch, kv_heads, length, dim = cache.shape
    tokens = cache.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    return tokens[layout.keys].permute(2, 0, 1, 3)


def _register_with_transformers() -> None:
    try:
        from transformers import AttentionInterface  # noqa: PLC0415 - optional: a trainer may go without it
    except ImportError:
        return
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: PLC0415

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    # flash-attention's mask function hands the attention the 2D padding mask as it is (None without padding)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)


_register_with_transformers()
