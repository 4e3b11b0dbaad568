"""Real PEFT LoRA adapters on the tiny test models, written with ``peft`` itself (``save_pretrained``).

``init_lora_weights=False`` draws ``lora_B`` at random too (PEFT's default starts it at zero, an adapter
that changes nothing); ``b_scale`` makes its delta large enough that greedy tokens differ from the base.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(model_dir: str | Path, out_dir: str | Path, rank: int, seed: int,
                      targets: list[str] | None = None, alpha: int | None = None, use_rslora: bool = False,
                      b_scale: float = 4.0, parameters: list[str] | None = None) -> Path:
    """Write a PEFT adapter of ``rank`` for the model in ``model_dir`` to ``out_dir``; ``parameters``: PEFT's
    ``target_parameters`` (MoE experts: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)."""
    import peft  # noqa: PLC0415 - test extra

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank,
                             target_modules=(targets or ALL_PROJECTIONS) if targets != [] else [],
                             target_parameters=parameters, init_lora_weights=False, use_rslora=use_rslora,
                             lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_model(model_dir: str | Path, adapter_dir: str | Path):
    """transformers + PEFT with the adapter applied (float32, eval): the reference the engine is held to."""
    import peft  # noqa: PLC0415

    # eager experts: transformers' default grouped GEMM of MoE experts rounds otherwise (see the trainer parity docs)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             experts_implementation="eager")
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()
