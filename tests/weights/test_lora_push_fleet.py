"""LoRA adapter versions pushed from trainer memory into a real fleet (issue 40, RL), gloo on CPU.

A coordinator and an engine process (``--enable-lora``, ``--max-lora-versions 2``) serve a tiny Llama;
this test process is the trainer: it holds PEFT models and pushes them with ``WeightSender.send_lora``.
A pushed version serves the tokens that the same adapter loaded from its directory gives in a lone
direct-mode engine (==), with its version on every token; requests admitted under version N finish
under N (==, against N alone) while later requests get N+1; a push that would leave three versions
resident is refused until the oldest requests finish; bad pushes are refused with nothing changed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from megatron_serve import WeightSender
from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.client.outputs import StreamPartial
from megatron_serve.config import InferenceConfig
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import process_fleet
from ..lora_adapters import make_peft_adapter, peft_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "Once upon a time"]
RANK = 8


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=tokens, ignore_eos=True, lora_name="a")


SHORT, LONG = greedy(8), greedy(160)


@pytest.fixture(scope="module")
def versions(tiny_llama, tmp_path_factory):
    """Three adapter versions (PEFT directories), and each one's tokens alone in a direct-mode engine (the long
    requests' only of the first two: only those are compared)."""
    root = tmp_path_factory.mktemp("lora-push")
    dirs = [str(make_peft_adapter(tiny_llama, root / f"v{v}", rank=RANK, seed=10 + v)) for v in (1, 2, 3)]

    def alone(directory: str, long: bool) -> SimpleNamespace:
        config = InferenceConfig(num_kv_blocks=64, enable_lora=True, max_lora_rank=RANK, lora_modules={"a": directory})
        with MegatronLLM(tiny_llama, config) as llm:
            return SimpleNamespace(short=[r.generated_tokens for r in llm.generate(PROMPTS, SHORT)],
                                   long=[r.generated_tokens for r in llm.generate(PROMPTS[:2], LONG)] if long else None)

    expected = [alone(d, long=i < 2) for i, d in enumerate(dirs)]
    assert expected[0].short != expected[1].short != expected[2].short, "control: the versions differ"
    assert expected[0].long != expected[1].long, "control: a request switched to version 2 would differ"
    return SimpleNamespace(dirs=dirs, expected=expected)


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory):
    engine = ("--enable-lora", "--max-loras", "3", "--max-lora-rank", str(RANK), "--max-lora-versions", "2",
              "--num-kv-blocks", "256")
    with process_fleet(tmp_path_factory.mktemp("lora-push-logs"), tiny_llama, [engine]) as fleet:
        yield fleet


async def stream(client: InferenceClient, prompt: str, params: SamplingParams, started: asyncio.Event):
    """Run one request, setting ``started`` at its first tokens; returns the finished request."""
    async for item in client.add_request_streaming(prompt, params):
        if isinstance(item, StreamPartial):
            started.set()
        else:
            return item
    raise AssertionError("the stream ended without its request")


async def start(client: InferenceClient, prompts: list[str], params: SamplingParams) -> list[asyncio.Task]:
    """Requests running on the engine (each produced tokens already)."""
    events = [asyncio.Event() for _ in prompts]
    tasks = [asyncio.ensure_future(stream(client, p, params, e)) for p, e in zip(prompts, events)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    return tasks


async def push(sender: WeightSender, directory: str, tiny_llama: str, version: int) -> dict:
    model = peft_model(tiny_llama, directory)
    return await asyncio.wait_for(sender.send_lora("a", model, version=version), 120)


async def test_adapter_versions_pushed_from_a_trainer(fleet, versions, tiny_llama):
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(1, timeout=300)
        sender = WeightSender(client, backend="gloo", timeout=60)
        await client.pause()
        ack = await push(sender, versions.dirs[0], tiny_llama, 1)
        assert ack["detail"]["lora"] == {"name": "a", "version": 1} and ack["detail"]["epoch"] == 0
        assert ack["detail"]["sender"]["bytes"] > 0
        await client.unpause()
        first = await asyncio.gather(*(client.add_request(p, SHORT) for p in PROMPTS))
        assert [r.generated_tokens for r in first] == versions.expected[0].short
        assert all(set(r.lora_epochs) == {1} and set(r.policy_epochs) == {0} for r in first)
        base = await client.add_request(PROMPTS[0], SamplingParams(temperature=0.0, num_tokens_to_generate=8,
                                                                    ignore_eos=True))
        assert set(base.lora_epochs) == {-1}

        # version 2 arrives while two requests of version 1 run: they finish under 1, new ones get 2
        running = await start(client, PROMPTS[:2], LONG)
        await client.pause()
        assert not any(task.done() for task in running), "they run while version 2 arrives"
        ack = await push(sender, versions.dirs[1], tiny_llama, 2)
        assert ack["detail"]["lora"] == {"name": "a", "version": 2}
        await client.unpause()
        second = await asyncio.gather(*(client.add_request(p, SHORT) for p in PROMPTS))
        assert [r.generated_tokens for r in second] == versions.expected[1].short
        assert all(set(r.lora_epochs) == {2} for r in second)
        old = await asyncio.gather(*running)
        assert [r.generated_tokens for r in old] == versions.expected[0].long
        assert all(set(r.lora_epochs) == {1} for r in old)

        # requests on versions 2 and 3 at once: a fourth version would make three resident (refused)
        on_two = await start(client, PROMPTS[:1], greedy(400))
        await client.pause()
        await push(sender, versions.dirs[2], tiny_llama, 3)
        await client.unpause()
        on_three = await start(client, PROMPTS[1:2], greedy(400))
        await client.pause()
        with pytest.raises(ControlError, match=r"running requests use versions \[2, 3\].*--max-lora-versions 2"):
            await push(sender, versions.dirs[0], tiny_llama, 4)
        await client.unpause()
        finished = await asyncio.gather(*on_two, *on_three)
        assert [set(r.lora_epochs) for r in finished] == [{2}, {3}]
        await client.pause()
        ack = await push(sender, versions.dirs[0], tiny_llama, 4)  # the old versions were freed
        assert ack["detail"]["lora"]["version"] == 4
        await client.unpause()
        fourth = await asyncio.gather(*(client.add_request(p, SHORT) for p in PROMPTS))
        assert [r.generated_tokens for r in fourth] == versions.expected[0].short
        assert all(set(r.lora_epochs) == {4} for r in fourth)


def _pairs(config, rank: int, scale: float = 0.05) -> dict:
    """``{module: (A, B)}`` for every q_proj/down_proj of the tiny model."""
    hidden, inner, q = config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim
    out = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        out[f"{prefix}.self_attn.q_proj"] = (torch.randn(rank, hidden) * scale, torch.randn(q, rank) * scale)
        out[f"{prefix}.mlp.down_proj"] = (torch.randn(rank, inner) * scale, torch.randn(hidden, rank) * scale)
    return out


async def test_bad_pushes_are_refused_with_nothing_changed(fleet, versions, tiny_llama):
    import transformers  # noqa: PLC0415

    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    async with InferenceClient(fleet.address, token=fleet.children.secret) as client:
        await client.wait_for_engines(1, timeout=300)
        sender = WeightSender(client, backend="gloo", timeout=60)
        await client.pause()
        good = _pairs(config, RANK)
        ack = await asyncio.wait_for(sender.send_lora("b", good, version=5, rank=RANK, alpha=16), 120)
        assert ack["detail"]["lora"] == {"name": "b", "version": 5}
        a, b = good["model.layers.0.mlp.down_proj"]
        past = config.num_hidden_layers  # a layer the model does not have
        bad = {
            "lora_A \\(8, 16\\) and lora_B": ({**good, "model.layers.0.mlp.down_proj": (a[:, :16], b)}, RANK),
            f"rank {2 * RANK} is above --max-lora-rank {RANK}": (_pairs(config, 2 * RANK), 2 * RANK),
            "model.layers.0.mlp.gate.lora_A.weight is not a LoRA weight": (
                {**good, "model.layers.0.mlp.gate": (a, b)}, RANK),
            f"layers.{past}.self_attn.q_proj.lora_A.weight names a module the base model does not": (
                {**good, f"model.layers.{past}.self_attn.q_proj": good["model.layers.0.self_attn.q_proj"]}, RANK),
            "version 5 is not newer than the served version 5": (good, RANK),
        }
        for message, (weights, rank) in bad.items():
            with pytest.raises(ControlError, match=message) as err:
                await asyncio.wait_for(sender.send_lora("b", weights, version=5 if "newer" in message else 6,
                                                        rank=rank, alpha=16), 120)
            assert err.value.code == "refit_failed"
        status = await client.status()
        assert status["epoch"] == 0 and all(e["epoch"] == 0 for e in status["engines"])
        await client.unpause()
        # still version 5 serving: each token says so
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, lora_name="b")
        again = await asyncio.gather(*(client.add_request(p, params) for p in PROMPTS[:2]))
        assert all(set(r.lora_epochs) == {5} for r in again)
