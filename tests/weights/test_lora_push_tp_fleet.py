"""An adapter pushed from trainer memory into a tensor-parallel engine group (TP=2, two gloo rank processes).

The coordinator gives the group one rank of the transfer (its rank 0 receives the adapter and sends each rank
its share when it writes a slot), so the push completes and the group serves the tokens a lone TP=1 direct-mode
engine gives with the same adapter from its directory (==), with the pushed version on every token; also for
an adapter on MoE experts (PEFT ``target_parameters``), whose share each rank takes of every expert.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from megatron_serve import WeightSender
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.launcher_client import Launcher
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import Children, free_port, shared_launcher
from ..lora_adapters import make_peft_adapter, peft_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4"]
RANK = 8
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, lora_name="a")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Iterator[Launcher]:
    """One engine launcher for the fleets of this module's tests: each launcher's start imports torch again."""
    with shared_launcher(tmp_path_factory.mktemp("lora-tp-launcher")) as launcher:
        yield launcher


@pytest.fixture(params=["llama", "qwen2_moe experts"])
def model_and_adapter(request, tiny_llama, tmp_path) -> tuple[str, str]:
    """A model and a PEFT adapter of it: every projection of the tiny Llama, or attention and the experts of a
    Qwen2-MoE (both layers sparse, each beside a shared expert)."""
    if request.param == "llama":
        return tiny_llama, str(make_peft_adapter(tiny_llama, tmp_path / "adapter", rank=RANK, seed=11))
    model = str(make_tiny_model(tmp_path / "moe", seed=5, arch="qwen2_moe"))
    return model, str(make_peft_adapter(model, tmp_path / "adapter", rank=RANK, seed=11, targets=["q_proj", "v_proj"],
                                        parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                        b_scale=2.0))


async def test_a_push_into_a_tensor_parallel_group_serves_the_adapter(model_and_adapter, launcher, tmp_path):
    model, directory = model_and_adapter
    config = InferenceConfig(num_kv_blocks=64, enable_lora=True, max_lora_rank=RANK, lora_modules={"a": directory})
    with MegatronLLM(model, config) as llm:
        expected = [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]
        base = [r.generated_tokens for r in llm.generate(PROMPTS, SamplingParams(**{**GREEDY.to_dict(),
                                                                                    "lora_name": None}))]
    assert expected != base, "control: the adapter changes the tokens"
    (tmp_path / "logs").mkdir()
    children = Children(tmp_path / "logs", launcher=launcher)
    port = free_port()
    try:
        children.coordinator(model, port)
        children.engine(model, port, "--tensor-parallel", "2", "--enable-lora", "--max-lora-rank", str(RANK))
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
            await client.wait_for_engines(1, timeout=300)
            sender = WeightSender(client, backend="gloo", timeout=60)
            await client.pause()
            ack = await asyncio.wait_for(sender.send_lora("a", peft_model(model, directory), version=1), 120)
            assert ack["detail"]["lora"] == {"name": "a", "version": 1}
            assert ack["detail"]["sender"]["world_size"] == 2  # the sender and the group's rank 0
            await client.unpause()
            outs = await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
            assert [r.generated_tokens for r in outs] == expected
            assert all(set(r.lora_epochs) == {1} for r in outs)
    finally:
        children.kill_all()
