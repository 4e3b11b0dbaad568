"""A bf16 trainer's weights into an FP8 fleet (RL rollouts in FP8), gloo on CPU.

The fleet serves a block-wise FP8 checkpoint of model A with an FP8 KV cache, in two engine groups
(one tensor-parallel 2). A trainer process (``trainer.py``: transformers' float weights of B and a
``WeightSender``) pushes B; every engine quantizes each tensor on arrival with its own layout (each
rank its slice). Afterwards the fleet's greedy tokens and log probs are those of an FP8 engine
loaded from B quantized the same way, with the new epoch on every token; the same holds after a
refit from B's float directory.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.config import InferenceConfig
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..devices import tensor_parallel_device
from ..helpers import process_fleet
from ..fp8_checkpoints import block_fp8_checkpoint
from .test_weight_sync_fleet import PROMPTS, run_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = (16, 16)  # divides every tensor-parallel slice of the tiny model's projections
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, return_log_probs=True)
FP8_KV = ("--kv-cache-dtype", "fp8")
# every engine and the reference on one device: where one GPU cannot hold the tensor-parallel group's two ranks, all
# of them on CPU (an FP8 engine's tokens on a GPU are not the CPU's: its prefill quantizes activations)
DEVICE = tensor_parallel_device(2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-weight-sync")
    a, b = make_tiny_model(root / "a", seed=0), make_tiny_model(root / "b", seed=1)
    a_fp8, b_fp8 = block_fp8_checkpoint(a, root / "a-fp8", BLOCK), block_fp8_checkpoint(b, root / "b-fp8", BLOCK)
    with MegatronLLM(str(b_fp8), InferenceConfig(num_kv_blocks=64, kv_cache_dtype="fp8", device=DEVICE)) as llm:
        expected_b = [(r.generated_tokens, r.generated_log_probs) for r in llm.generate(PROMPTS, GREEDY)]
    return SimpleNamespace(a_fp8=str(a_fp8), b=str(b), expected_b=expected_b)


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    engines = [("--group", "0", "--device", DEVICE, *FP8_KV),
               ("--group", "1", "--tensor-parallel", "2", "--device", DEVICE, *FP8_KV)]
    with process_fleet(tmp_path_factory.mktemp("fp8-weight-sync-logs"), models.a_fp8, engines) as fleet:
        yield fleet


async def assert_serves(client: InferenceClient, expected: list[tuple[list[int], list[float]]], epoch: int) -> None:
    results = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    assert [r.generated_tokens for r in results] == [tokens for tokens, _ in expected]
    for result, (_, log_probs) in zip(results, expected):  # the FP8 engine's own log probs
        assert result.generated_log_probs == pytest.approx(log_probs, abs=1e-4)
    assert all(set(r.policy_epochs) == {epoch} for r in results)


async def test_bf16_weights_into_an_fp8_fleet_serve_as_an_fp8_engine_loaded_from_them(fleet, models):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await fleet.children.registered(client, 2)
        await client.pause()
        code, lines = await asyncio.to_thread(run_trainer, fleet, models.b, 7)
        assert code == 0, lines
        ack = lines[-1]
        assert ack["detail"]["epoch"] == 7 and ack["detail"]["sender"]["world_size"] == 4
        await client.unpause()
        await assert_serves(client, models.expected_b, 7)

        # the same weights from B's float directory: quantized on arrival alike
        await client.pause()
        await client.refit(models.b, 8)
        await client.unpause()
        await assert_serves(client, models.expected_b, 8)
