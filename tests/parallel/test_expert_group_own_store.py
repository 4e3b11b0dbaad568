"""An expert-parallel group of three data-parallel attention ranks (one engine process each, gloo) that meets in a
``rendezvous-store`` process of its own: rank 0, whose engine would otherwise host the store, SIGKILLed mid-stream;
ranks 1 and 2 serve on in their own processes (rank 1 now leads), every stream completes with the uninterrupted
tokens (``--batch-invariant``), and rank 0's restart joins them as any lost rank's does."""

from __future__ import annotations

import pytest

from megatron_serve.model.tiny import make_tiny_model

from ..model.test_moe import VARIANTS
from .expert_group_stack import expert_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 32


async def test_rank_zeros_loss_is_survived_and_its_restart_joins(tmp_path):
    twelve = {**VARIANTS["qwen3_moe"], "num_experts": 12}  # 4 experts on each of the 3 ranks
    model = str(make_tiny_model(tmp_path / "m", seed=1, num_heads=4, num_kv_heads=2, **twelve))
    async with expert_group(tmp_path, TOKENS, model, ranks=3, own_store=True) as group:
        first, second = await group.kill_mid_stream(0)
        await group.logged(first, "expert-parallel rank 1 is rank 0 of the 2 left", 30)
        served = await group.served_by_each()
        assert len(served) == 2 and all(served.values()), served

        await group.rejoin(0)
        assert first.poll() is None and second.poll() is None
