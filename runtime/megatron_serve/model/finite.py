"""The one check every path that brings weights in runs before anything is applied: no NaN, no infinity.

A tensor holding NaN or an infinity serves nothing useful (a NaN adapter's completions come back empty with
null log probs; an all-NaN ``lm_head`` samples garbage), and once loaded it poisons every request that touches
it. So checkpoint loads, refits (a directory, tensors in this process, a trainer's push), LoRA adapters (a
directory, a push) and the drafter's tensors all pass through :func:`refuse_nonfinite` in their verify step, and
a refusal names the tensor.

How: one ``aminmax`` reduction per tensor. NaN propagates into both results and an infinity is an extreme, so a
tensor is finite exactly when its minimum and maximum are. The reduction reads the tensor once and allocates
nothing of its size (``isfinite(t).all()`` writes a boolean tensor as large as ``t`` and ran 35 times slower on
CPU). On a device the flags of every tensor stay there and are read with one synchronisation per call. FP8 data
(``float8_e4m3fn``: NaN is its only non-finite value, no infinity) is checked on its bit pattern.
"""

from __future__ import annotations

from typing import Iterable

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FP8_NAN = 0x7F  # float8_e4m3fn: exponent and mantissa all ones (either sign) is NaN


class NonFiniteWeights(ValueError):
    """A tensor holds NaN or an infinity; the message names it (what every load path reports)."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"{what}: tensor {name} holds NaN or infinite values; nothing was applied")
        self.tensor = name


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor | None:
    """A 0-d boolean on the tensor's device, True when ``tensor`` holds NaN or an infinity; None for dtypes that
    cannot (integers) or an empty tensor."""
    if tensor.numel() == 0:
        return None
    if tensor.dtype in _FLOATS:
        low, high = torch.aminmax(tensor.detach())
        return ~(torch.isfinite(low) & torch.isfinite(high))
    if tensor.dtype == torch.float8_e4m3fn:
        return ((tensor.detach().view(torch.uint8) & _FP8_NAN) == _FP8_NAN).any()
    return None


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding NaN or an infinity, or None when all are finite."""
    names: list[str] = []
    flags: list[torch.Tensor] = []
    for name, tensor in named:
        flag = _nonfinite(tensor)
        if flag is None:
            continue
        if flag.device.type == "cpu":
            if bool(flag):
                return name
            continue
        names.append(name)  # a device's flags are read together, below
        flags.append(flag)
    if flags:
        bad = torch.stack(flags).nonzero()
        if len(bad):
            return names[int(bad[0])]
    return None


def refuse_nonfinite(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise :class:`NonFiniteWeights` naming the first tensor of ``named`` that holds NaN or an infinity;
    ``what`` says what was being loaded (the message's start: "REFIT", "LoRA adapter 'sql'", a checkpoint)."""
    name = first_nonfinite(named)
    if name is not None:
        raise NonFiniteWeights(name, what)
