"""An EAGLE-3 draft head as published for Llama-3 (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``).

The directory holds ``config.json`` (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``draft_vocab_size``, optional ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
safetensors with

- ``fc.weight`` ``[hidden, 3 * hidden]``: fuses the target's hidden states at three layers (by default the
  inputs of layers ``2, L // 2, L - 3``, as vLLM's and EAGLE's training code pick them),
- ``midlayer.*``: one decoder layer whose q/k/v projections read ``2 * hidden`` features,
  ``cat(input_layernorm(embed(token)), hidden_norm(h))``, the residual being ``h``,
- ``norm.weight`` and ``lm_head.weight`` ``[draft_vocab, hidden]``: logits over the draft vocabulary,
- ``d2t``: draft id -> target id offset (``target = draft + d2t[draft]``); ``t2d`` (the reverse mask) is unused.

The embedding is the target's. One step: ``h' = midlayer(embed(token), h)`` with ``h = fc(cat(aux))`` for the
first guess and the midlayer's own pre-norm output for the chained ones. Plain torch plus the paged attention
ops: guesses only decide how many tokens a verify step accepts, never which tokens the target emits.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable

import torch
from safetensors import safe_open
from torch import nn

from .attention import ForwardContext, PagedAttention
from .config import ModelConfig
from .layers import rotary_cos_sin


class Eagle3CheckpointError(ValueError):
    """The EAGLE-3 directory does not fit the target (missing tensor, wrong shape, other vocabulary)."""


def aux_layer_ids(raw: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head fuses: the config's ids, else ``(2, L // 2, L - 3)``."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(0 < i < num_layers for i in ids):
        raise Eagle3CheckpointError(f"EAGLE-3 needs three aux layers inside the target's 1..{num_layers - 1} "
                                    f"(a target of at least 4 layers), got {list(ids)}")
    return ids


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Eagle3Head(nn.Module):
    """The EAGLE-3 head's tensors (checkpoint names, ``midlayer.`` prefix stripped) and its one step."""

    def __init__(self, model_dir: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        hidden = raw["hidden_size"]
        heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads", raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden // heads
        draft_vocab = raw.get("draft_vocab_size") or raw.get("vocab_size")
        if hidden != target.hidden_size:
            raise Eagle3CheckpointError(f"EAGLE-3 hidden_size {hidden} != the target's {target.hidden_size}")
        if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
            raise Eagle3CheckpointError(f"EAGLE-3 vocab_size {raw['vocab_size']} != the target's {target.vocab_size}")
        self.aux_layers = aux_layer_ids(raw, target.num_layers)
        self.eps = raw.get("rms_norm_eps", 1e-6)
        self.head_dim, self.heads, self.kv_heads = head_dim, heads, kv_heads
        self.config = SimpleNamespace(num_layers=1, head_dim=head_dim)  # what the draft KV cache reads
        self.num_local_kv_heads = kv_heads
        inter = raw["intermediate_size"]
        shapes = {"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,),
                  "lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,),
                  "midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
                  "midlayer.post_attention_layernorm.weight": (hidden,),
                  "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
                  "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
                  "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
                  "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
                  "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
                  "midlayer.mlp.down_proj.weight": (hidden, inter)}
        self.shapes = shapes
        tensors = _read(model_dir)
        for name, shape in shapes.items():
            if name not in tensors:
                raise Eagle3CheckpointError(f"EAGLE-3 checkpoint {model_dir} lacks {name}")
            if tuple(tensors[name].shape) != shape:
                raise Eagle3CheckpointError(f"EAGLE-3 tensor {name} has shape {tuple(tensors[name].shape)}, "
                                            f"expected {shape}")
        draft_to_target = torch.arange(draft_vocab) + tensors["d2t"].long()
        if draft_to_target.min() < 0 or draft_to_target.max() >= target.vocab_size:
            raise Eagle3CheckpointError(f"EAGLE-3 d2t maps draft ids outside the target's vocabulary "
                                        f"of {target.vocab_size}")
        self.register_buffer("draft_to_target", draft_to_target.to(device), persistent=False)
        self.weights = {name.removeprefix("midlayer."): tensors[name].to(device=device, dtype=dtype)
                        for name in shapes if name != "d2t"}
        self.attn = PagedAttention(0, head_dim**-0.5, device)
        cos, sin = rotary_cos_sin(head_dim, target.max_position_embeddings, target.rope)
        self.register_buffer("rotary_cos", cos.to(device), persistent=False)
        self.register_buffer("rotary_sin", sin.to(device), persistent=False)
        self.dtype = dtype

    def check(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """``ValueError`` naming the first tensor that is not the head's or has another shape (a refit's check)."""
        for name, shape in shapes:
            want = self.shapes.get(name)
            if name in IGNORED:
                continue
            if want is None:
                raise ValueError(f"{name!r} is not a tensor of the EAGLE-3 head (expected {', '.join(self.shapes)})")
            if tuple(shape) != want:
                raise ValueError(f"EAGLE-3 tensor {name} has shape {tuple(shape)}, expected {want}")

    def load(self, named: Iterable[tuple[str, object]], partial: bool) -> None:
        """Copy refit tensors (checkpoint names; full tensors or slices of them) into the head in place."""
        missing = set(self.shapes) - set(IGNORED)
        for name, source in named:
            tensor = source if isinstance(source, torch.Tensor) else source[:]
            if name not in IGNORED:
                self.weights[name.removeprefix("midlayer.")].copy_(tensor)
            missing.discard(name)
        if missing and not partial:
            raise ValueError(f"the EAGLE-3 head's refit lacks {', '.join(sorted(missing))}")

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` of the target's three concatenated hidden states (``[T, 3 * hidden]`` -> ``[T, hidden]``)."""
        return aux @ self.weights["fc.weight"].T

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             context: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft-vocabulary logits, pre-norm hidden for the next step)`` of every row (keys/values cached)."""
        w, eps = self.weights, self.eps
        x = torch.cat([_rms(embeds, w["input_layernorm.weight"], eps), _rms(hidden, w["hidden_norm.weight"], eps)], -1)
        q = (x @ w["self_attn.q_proj.weight"].T).view(-1, self.heads, self.head_dim)
        k = (x @ w["self_attn.k_proj.weight"].T).view(-1, self.kv_heads, self.head_dim)
        v = (x @ w["self_attn.v_proj.weight"].T).view(-1, self.kv_heads, self.head_dim)
        q = self.attn.store(q, k, v, positions, self.rotary_cos, self.rotary_sin, context)
        attended = self.attn.attend(q, context).flatten(1) @ w["self_attn.o_proj.weight"].T
        residual = hidden + attended
        y = _rms(residual, w["post_attention_layernorm.weight"], eps)
        y = (torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)
             ) @ w["mlp.down_proj.weight"].T
        out = residual + y
        return (_rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T).float(), out


# The vocabulary maps (integers, not trained): a refit keeps the head's own; ``t2d`` is not even read at load.
IGNORED = ("d2t", "t2d")


def _read(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise Eagle3CheckpointError(f"EAGLE-3 directory {model_dir} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors
