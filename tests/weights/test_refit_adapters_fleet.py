"""LoRA adapter versions in the policy's refit (issue 50, build item 4), real processes, gloo on CPU.

A coordinator and two engine groups (tensor-parallel 1 and 2, ``--enable-lora``) serve model A with adapter ``a``
(version 0, from a directory); this test process is the trainer. ``WeightSender.send(policy B, epoch=1,
adapters={"a": new adapter})`` makes both change in one transaction: afterwards requests of ``a`` give the tokens
of a server of B with the new adapter (==), with epoch 1 for the policy and version 1 for the adapter on every
token, and requests without it those of a server of B. An adapter that does not fit (a rank above
``--max-lora-rank``) refuses the whole refit first: the fleet keeps epoch 0, A and the old adapter, and serves them
(==).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from megatron_serve import WeightSender
from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import Children, free_port
from ..lora_adapters import make_peft_adapter, peft_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):"]
RANK = 8
BASE = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
ADAPTED = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, lora_name="a")


def served(model: str, adapter: str) -> SimpleNamespace:
    """What a lone direct-mode engine of ``model`` with ``adapter`` as ``a`` generates, with and without it."""
    config = InferenceConfig(num_kv_blocks=64, enable_lora=True, max_lora_rank=RANK, lora_modules={"a": adapter})
    with MegatronLLM(model, config) as llm:
        return SimpleNamespace(adapted=[r.generated_tokens for r in llm.generate(PROMPTS, ADAPTED)],
                               base=[r.generated_tokens for r in llm.generate(PROMPTS, BASE)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit-adapters")
    a, b = str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1))
    old = str(make_peft_adapter(a, root / "old", rank=RANK, seed=20))
    new = str(make_peft_adapter(b, root / "new", rank=RANK, seed=21))
    too_wide = str(make_peft_adapter(b, root / "wide", rank=2 * RANK, seed=22))
    before, after = served(a, old), served(b, new)
    assert before.adapted != after.adapted and before.base != after.base, "control: the refit changes the tokens"
    assert after.adapted != served(b, old).adapted, "control: the new adapter's tokens are not the old one's on B"
    return SimpleNamespace(a=a, b=b, old=old, new=new, too_wide=too_wide, before=before, after=after)


async def generate(client: InferenceClient, params: SamplingParams) -> list:
    return await asyncio.gather(*(client.add_request(p, params) for p in PROMPTS))


async def check_serves(client: InferenceClient, expected: SimpleNamespace, epoch: int) -> None:
    """The fleet generates ``expected``'s tokens with the adapter and without, the adapted requests under policy and
    adapter ``epoch``."""
    adapted, base = await generate(client, ADAPTED), await generate(client, BASE)
    assert [r.generated_tokens for r in adapted] == expected.adapted
    assert [r.generated_tokens for r in base] == expected.base
    assert all(set(r.lora_epochs) == {epoch} and set(r.policy_epochs) == {epoch} for r in adapted)


async def test_adapters_travel_with_the_policy_or_not_at_all(setup, tmp_path):
    (tmp_path / "logs").mkdir()
    children = Children(tmp_path / "logs")
    port = free_port()
    flags = ("--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", f"a={setup.old}")
    policy = sorted(load_file(str(Path(setup.b) / "model.safetensors")).items())
    try:
        children.coordinator(setup.a, port)
        children.engine(setup.a, port, "--group", "0", *flags)
        children.engine(setup.a, port, "--group", "1", "--tensor-parallel", "2", *flags)
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
            await client.wait_for_engines(2, timeout=300)
            assert [r.generated_tokens for r in await generate(client, ADAPTED)] == setup.before.adapted
            sender = WeightSender(client, backend="gloo", bucket_bytes=64 << 10, timeout=60)

            # a bad adapter refuses the policy with it: nothing changed anywhere, the fleet serves as before
            await client.pause()
            with pytest.raises(ControlError) as refused:
                await asyncio.wait_for(sender.send(policy, epoch=1, adapters={"a": setup.too_wide}), 120)
            assert refused.value.code == "refit_failed" and "'a'" in str(refused.value)
            assert "keeps serving epoch 0" in str(refused.value)
            status = await client.status()
            assert status["epoch"] == 0 and {e["epoch"] for e in status["engines"]} == {0}
            await client.unpause()
            await check_serves(client, setup.before, 0)

            # policy and adapter in one transaction: both change, under epoch 1, on every engine
            await client.pause()
            ack = await asyncio.wait_for(sender.send(policy, epoch=1, adapters={"a": peft_model(setup.b, setup.new)}),
                                         120)
            assert ack["detail"]["epoch"] == 1 and ack["detail"]["adapters"] == {"a": 1}
            assert len(ack["detail"]["receivers"]) == 3  # every engine rank took part (1 + 2)
            await client.unpause()
            await check_serves(client, setup.after, 1)
            assert {e["epoch"] for e in (await client.status())["engines"]} == {1}
    finally:
        children.kill_all()
