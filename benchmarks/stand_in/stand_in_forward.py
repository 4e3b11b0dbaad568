"""A forward that costs nothing: ``ModelRunner.run_plan`` answers every step at once with fixed logits of the
model's vocabulary, so that a served stack's tokens/s and CPU are the host's alone (scheduler, sampler, output path,
coordinator, HTTP server), what ``benchmarks/host_ceiling.py`` measures.

The step is still planned (``write_plan`` fills the host buffers) and sampled as always: only the model is skipped.
The logits are one fixed random matrix, a row per sampled row of a step: row ``r`` is the same every step, the
tokenizer's trained words weighted above its placeholder words (a sampled token is mostly text), so greedy rows
repeat one word each and sampled rows draw over the whole vocabulary, at its real size (the model's
``vocab_size``: the sampler's work is a real model's).

Installed before the engine imports its runner (:func:`install`, from ``sitecustomize``): an import hook replaces
the method as the module is loaded, in every process of the stack that loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

RUNNER = "megatron_serve.engine.runner"
#: ids below this are the tiny tokenizer's trained words (``make_tiny_model``'s default ``tokenizer_vocab_size``)
TRAINED_WORDS = 512


class FixedLogits:
    """The rows handed out, grown (and drawn again, from the same seed) when a step samples more rows than held."""

    def __init__(self) -> None:
        self._rows: Any = None

    def take(self, rows: int, vocab: int, device: Any) -> Any:
        import torch  # noqa: PLC0415 - the engine's process has it loaded already

        held = self._rows
        if held is None or held.shape[0] < rows or held.shape[1] != vocab or held.device != device:
            size = max(rows, 2 * (0 if held is None else held.shape[0]), 64)
            generator = torch.Generator().manual_seed(0)
            drawn = torch.randn(size, vocab, generator=generator)
            drawn[:, :TRAINED_WORDS] += 2.0  # words over placeholders
            drawn[:, TRAINED_WORDS:] -= 4.0
            self._rows = held = drawn.to(device)
        return held[:rows]


def stand_in_run_plan(logits: FixedLogits, result_type: type) -> Any:
    """``ModelRunner.run_plan`` without the model: the step's logits rows at once."""

    def run_plan(self: Any, plan: Any, kv_caches: Any, *args: Any, **kwargs: Any) -> Any:
        rows = plan.num_sample + plan.num_score + plan.num_verify
        return result_type(logits.take(rows, self.model.config.vocab_size, self.device))

    return run_plan


def patch(module: ModuleType) -> None:
    """Give ``module``'s ``ModelRunner`` the stand-in forward."""
    module.ModelRunner.run_plan = stand_in_run_plan(FixedLogits(), module.StepResult)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch(module)


class _RunnerFinder(importlib.abc.MetaPathFinder):
    """Finds the runner module as the other finders do, and loads it through :class:`_PatchingLoader`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != RUNNER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Patch the runner now if it is loaded, else when it is."""
    if RUNNER in sys.modules:
        patch(sys.modules[RUNNER])
    elif not any(isinstance(finder, _RunnerFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RunnerFinder())
