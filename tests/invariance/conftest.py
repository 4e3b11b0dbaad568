"""Tiny checkpoints the invariance tests share: a dense Llama, a Qwen3 (q/k norms) and three MoE families."""

from __future__ import annotations

import pytest

from megatron_serve.model.tiny import make_tiny_model

from .runs import RECIPE_COMPLETION, RECIPE_PROMPTS, run_prompts

from ..threads import default_threads  # noqa: F401 - autouse: this folder runs at torch's default threads


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("invariance")
    return {arch: str(make_tiny_model(root / arch, seed=0, arch=arch))
            for arch in ("llama", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")}


@pytest.fixture(scope="session")
def recipe_runs(models):
    """Per (arch, dtype): the engine's runs of the recipes' prompts, shared by the Megatron-core and TorchTitan
    tests."""
    cache = {}

    def get(arch: str, dtype: str):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = run_prompts(models[arch], dtype, RECIPE_PROMPTS, RECIPE_COMPLETION)
        return cache[arch, dtype]
    return get
