"""A pushed adapter version survives an engine restart (engine.lora_store): with ``--lora-push-dir`` the engine
writes the version it received, the coordinator records the directory, and the restarted engine process, which
registers later, loads it before serving: requests of the adapter get the pushed version's tokens (==, against
the same adapter from its directory in a direct-mode engine) with its version on every token. Control: without
``--lora-push-dir`` the restarted engine does not serve the adapter and the request fails."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from megatron_serve import WeightSender
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.launcher_client import Launcher
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import Children, free_port, shared_launcher
from ..lora_adapters import make_peft_adapter, peft_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "1 2 3 4"]
RANK = 8
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, lora_name="a")


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> tuple[str, list[list[int]]]:
    directory = str(make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("rejoin") / "a", rank=RANK, seed=12))
    config = InferenceConfig(num_kv_blocks=64, enable_lora=True, max_lora_rank=RANK, lora_modules={"a": directory})
    with MegatronLLM(tiny_llama, config) as llm:
        return directory, [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Iterator[Launcher]:
    """One engine launcher for the fleets of this module's tests: each launcher's start imports torch again."""
    with shared_launcher(tmp_path_factory.mktemp("rejoin-launcher")) as launcher:
        yield launcher


async def _deregistered(client: InferenceClient) -> None:
    """Poll until the coordinator lists no engine (the stopped one said goodbye)."""
    while (await client.status())["engines"]:
        await asyncio.sleep(0.05)


async def _push_then_restart(tiny_llama: str, directory: str, launcher: Launcher, tmp_path, *extra: str) -> list:
    """Push version 3 of ``a`` into a one-engine fleet, restart the engine process, and run :data:`PROMPTS`."""
    (tmp_path / "logs").mkdir()
    children = Children(tmp_path / "logs", launcher=launcher)
    port = free_port()
    flags = ("--enable-lora", "--max-lora-rank", str(RANK), *extra)
    try:
        children.coordinator(tiny_llama, port)
        first = children.engine(tiny_llama, port, *flags)
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret) as client:
            await client.wait_for_engines(1, timeout=300)
            await client.pause()
            await asyncio.wait_for(WeightSender(client, backend="gloo", timeout=60).send_lora(
                "a", peft_model(tiny_llama, directory), version=3), 120)
            await client.unpause()
            first.terminate()
            await asyncio.to_thread(first.wait, 60)
            await asyncio.wait_for(_deregistered(client), 60)
            children.engine(tiny_llama, port, *flags)
            await client.wait_for_engines(1, timeout=300)
            return await asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS))
    finally:
        children.kill_all()


async def test_a_restarted_engine_serves_the_pushed_version(tiny_llama, adapter, launcher, tmp_path):
    directory, expected = adapter
    outs = await _push_then_restart(tiny_llama, directory, launcher, tmp_path, "--lora-push-dir",
                                    str(tmp_path / "pushed"))
    assert [r.generated_tokens for r in outs] == expected
    assert all(set(r.lora_epochs) == {3} for r in outs)
    assert (tmp_path / "pushed" / "a" / "v3" / "adapter_model.safetensors").is_file()


async def test_without_a_push_dir_the_restarted_engine_lacks_the_adapter(tiny_llama, adapter, launcher, tmp_path):
    directory, _ = adapter
    outs = await _push_then_restart(tiny_llama, directory, launcher, tmp_path)
    assert [(r.generated_tokens, r.error) for r in outs] == [([], "LoRA adapter 'a' is not loaded")] * len(PROMPTS)
