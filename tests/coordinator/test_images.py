"""Images through the coordinator: placement, size limits, moves between engines, and a real fleet.

The fast tests run the real coordinator, engine link and client over sockets with fake engines
that record the images they receive; the last one serves a tiny LLaVA with real engine processes.
"""

from __future__ import annotations

import asyncio

import pytest
from PIL import Image

from megatron_serve import InferenceConfig, MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.multimodal import PromptImage
from megatron_serve.wire.protocol import MAX_MESSAGE_BYTES
from megatron_serve.wire.request import DynamicInferenceRequest, EngineRequest
from megatron_serve.tokenizer import Tokenizer

from ..images import png
from .fakes import FakeEngine, expected_tokens
from ..helpers import until

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)


class RecordingEngine(FakeEngine):
    """A fake engine that remembers what each request arrived with."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: dict[str, DynamicInferenceRequest] = {}

    def add_request(self, request: EngineRequest, kv_transfer_params: dict | None = None) -> None:
        super().add_request(request, kv_transfer_params)
        self.seen[request.request_id] = self.requests[request.request_id]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    from megatron_serve.model.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("coordinator-llava"), seed=0, arch="llava"))


async def test_request_moved_to_another_engine_keeps_its_images(fleet_factory):
    fleet = fleet_factory(heartbeat_timeout=1.0)
    first = RecordingEngine(step_delay=0.02)
    first_proc, _, _ = fleet.add_engine(fake=first)
    images = [PromptImage(png(20, 30, 1), offset=1, length=3), PromptImage(png(10, 10, 2), offset=5, length=2)]
    prompt = [7, 9, 9, 9, 8, 9, 9, 6]
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await client.wait_for_engines(1, timeout=20)
        future = client.add_request(prompt, SamplingParams(num_tokens_to_generate=40), images=images)
        await until(lambda: first.seen and next(iter(first.seen.values())).generated_tokens, 10, "first tokens")
        first_proc.link.heartbeat_interval = 3600  # the engine hangs: no steps, no heartbeats
        first.freeze()
        second = RecordingEngine()
        fleet.add_engine(fake=second)
        result = await asyncio.wait_for(future, 20)
        first.thaw()
    assert result.generated_tokens == expected_tokens(prompt, 40)
    assert any(e.type.value == "EVICT" for e in result.events), "the request must have moved"
    moved = next(iter(second.seen.values()))
    assert moved.generated_tokens, "it continued from the tokens generated on the first engine"
    assert [(i.data, i.offset, i.length) for i in moved.images] == [(i.data, i.offset, i.length) for i in images]
    assert result.images == [], "results do not carry the image files back"


async def test_the_client_places_images_of_text_prompts(fleet_factory, tiny_llava):
    """The caller's process expands the placeholders (the coordinator loads no tokenizer): the engine gets
    the ids and placed images the model's processor makes."""
    tokenizer = Tokenizer.from_pretrained(tiny_llava)
    fleet = fleet_factory()
    engine = RecordingEngine()
    fleet.add_engine(fake=engine)
    picture = png(40, 60, 3)
    async with InferenceClient(fleet.address, token=fleet.token, tokenizer=tokenizer) as client:
        await client.wait_for_engines(1, timeout=20)
        result = await client.add_request("Look: <image> what is it?", GREEDY, images=[picture])
        seen = next(iter(engine.seen.values()))
        expected_tokens_, expected_images = tokenizer.images.expand(tokenizer.encode("Look: <image> what is it?"),
                                                                    [picture])
        assert seen.prompt_tokens == expected_tokens_ == result.prompt_tokens
        assert [(i.data, i.offset, i.length) for i in seen.images] == [
            (i.data, i.offset, i.length) for i in expected_images]
        with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
            await client.add_request("Look: <image>", GREEDY, images=[picture, picture])
        with pytest.raises(ValueError, match="image 1: not an image"):
            await client.add_request("Look: <image>", GREEDY, images=[b"<html>not a picture</html>"])


async def test_image_limits(fleet_factory):
    fleet = fleet_factory()
    fleet.coordinator.core.flow.max_image_bytes = 1000  # set before any peer connects
    fleet.add_engine(fake=RecordingEngine())
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await client.wait_for_engines(1, timeout=20)
        big = PromptImage(b"x" * 1001, offset=0, length=1)
        with pytest.raises(ValueError, match="1001 bytes.*at most 1000 bytes of images per request"):
            await client.add_request([5, 6], GREEDY, images=[big])
        with pytest.raises(ValueError, match="no tokenizer"):  # nothing here can place them
            await client.add_request([5, 6], GREEDY, images=[b"tiny"])
        with pytest.raises(ValueError, match="exceeds the .*-byte limit"):  # refused before it is sent
            client.add_request([5, 6], GREEDY, images=[PromptImage(b"x" * MAX_MESSAGE_BYTES, offset=0, length=1)])
        assert client.num_pending == 0


@pytest.mark.slow
def test_coordinator_mode_equals_direct_mode(tiny_llava):
    prompts = [{"prompt": "<image> Describe it.", "images": [png(30, 40, 5)]},
               {"prompt": "Two: <image> and <image>.", "images": [png(20, 20, 6), Image.new("RGB", (50, 30), "red")]},
               "No image here."]
    config = InferenceConfig(num_kv_blocks=64)
    with MegatronLLM(tiny_llava, config) as llm:  # closed: its engine thread and KV cache do not outlive the test
        direct = [r.generated_tokens for r in llm.generate(prompts, GREEDY)]

    async def remote() -> list[list[int]]:
        async with MegatronAsyncLLM(tiny_llava, config, use_coordinator=True) as llm:
            batch = await llm.generate(prompts, GREEDY)
            items = [item async for item in llm.generate_stream(prompts[1], GREEDY)]
            assert items[-1].generated_tokens == direct[1]
            return [r.generated_tokens for r in batch]

    assert asyncio.run(remote()) == direct
