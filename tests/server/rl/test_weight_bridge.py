"""The weight bridge alone: the server's side of each framework's group against the trainer's side (gloo, threads).

The trainer side is :mod:`megatron_serve.client.trainer_group` built as each framework builds it (vLLM: the trainer
rank 0 serves the store; SGLang: its key prefixes; TRL: the server serves the store, the trainer the last rank).
Every tensor arrives bit for bit, packed or one by one; the fleet tests (``test_*_weights.py``) run it across
processes.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights
from megatron_serve.server.rl.weight_bridge import TrainerGroup
from megatron_serve.weights.framework_groups import TRL_PREFIX, Layout, announced, sglang_prefixes

from ...helpers import free_port

pytestmark = pytest.mark.timeout(120)

TENSORS = [("embed", torch.randn(5, 3)), ("norm", torch.randn(3).to(torch.bfloat16)), ("head", torch.randn(3, 5))]
METAS = announced([n for n, _ in TENSORS], [str(t.dtype) for _, t in TENSORS], [list(t.shape) for _, t in TENSORS])


def received(layout: Layout, trainer: dict, packed: bool, buffer_bytes: int = 40) -> list[tuple[str, torch.Tensor]]:
    """What the server's side receives while the trainer's side (``trainer``: trainer_init's keywords) sends."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joining = pool.submit(TrainerGroup.join, layout, 60)
        group = trainer_init("127.0.0.1", layout.port, layout.world_size, timeout=60, **trainer)
        server = joining.result()
        try:
            receiving = pool.submit(server.receive, METAS, packed, buffer_bytes)
            trainer_send_weights(TENSORS, group, packed=packed, buffer_bytes=buffer_bytes, src=layout.src)
            return receiving.result()
        finally:
            server.close()


@pytest.mark.parametrize("packed", [True, False])
def test_vllms_and_sglangs_layouts_carry_every_tensor_bit_for_bit(packed):
    for prefixes in ((), sglang_prefixes("weight_update_group", "gloo")):
        layout = Layout.trainer_first("127.0.0.1", free_port(), 1, 2, "gloo", prefixes)
        got = received(layout, {"prefixes": prefixes}, packed)
        assert [name for name, _ in got] == [name for name, _ in TENSORS]
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, TENSORS))


def test_trls_layout_has_the_server_serve_the_store_and_the_trainer_send_as_the_last_rank():
    layout = Layout.trainer_last("127.0.0.1", free_port(), 2, "gloo")
    got = received(layout, {"rank": 1, "prefixes": (TRL_PREFIX,), "serves_store": False}, packed=False)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, TENSORS))


def test_a_server_takes_every_receiving_rank_a_trainer_counted():
    """A trainer that counted the fleet's engine ranks (``/get_world_size``) waits for all of them: the server
    joins as each, and every one receives the broadcast."""
    layout = Layout.trainer_first("127.0.0.1", free_port(), 1, 4, "gloo")
    got = received(layout, {}, packed=True)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, TENSORS))
