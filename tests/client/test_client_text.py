"""``InferenceClient`` makes the text: its tokenizer, stop strings that end a request at the client.

A raw ROUTER plays the coordinator, so the test controls exactly which token ids arrive and sees
what the client sends back (the ABORT that frees the engine after a stop string).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import pytest

from megatron_serve.client.coordinator_client import CoordinatorError, InferenceClient
from megatron_serve.wire.messages import PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.request import FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.tokenizer import Tokenizer

from .test_client_acks import RawCoordinator

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


@contextlib.asynccontextmanager
async def registered(ack: dict, **options) -> AsyncIterator[tuple[RawCoordinator, InferenceClient]]:
    coordinator = RawCoordinator()
    client = InferenceClient(coordinator.address, **options)
    try:
        starting = asyncio.ensure_future(client.start(timeout=30))
        assert [m.header for m in await asyncio.to_thread(coordinator.frame)] == [Header.HELLO]
        coordinator.send(Header.HELLO_ACK, {"coordinator_id": "c", "state": "RUNNING", **ack})
        await starting
        yield coordinator, client
    finally:
        client.close()
        coordinator.router.close(linger=0)


async def received(coordinator: RawCoordinator) -> list:
    """The next frame's messages from the client, its heartbeats left out (a loaded machine sends them anywhere)."""
    while True:
        messages = [m for m in await asyncio.to_thread(coordinator.frame) if m.header is not Header.HEARTBEAT]
        if messages:
            return messages


async def test_a_stop_string_ends_the_request_here_and_the_fleet_is_told_to_drop_it(tokenizer):
    tokens = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    async with registered({"protocol": PROTOCOL_VERSION}, tokenizer=tokenizer) as (coordinator, client):
        params = SamplingParams(stop_words=["gamma"], num_tokens_to_generate=64, return_log_probs=True)
        stream = client.add_request_streaming([1, 2, 3], params, request_id="r")
        items = asyncio.ensure_future(_collect(stream))
        assert [m.header for m in await received(coordinator)] == [Header.SUBMIT]
        coordinator.send(Header.STEP_TOKENS, {"client_request_ids": ["r"], "deltas": [  # past the stop, in one go
            {"new_tokens": tokens, "new_log_probs": [-0.5] * len(tokens)}]})
        *pieces, final = await asyncio.wait_for(items, 10)
        keep = next(k for k in range(1, len(tokens) + 1) if "gamma" in tokenizer.decode(tokens[:k]))
        assert final.status is RequestStatus.COMPLETED and final.finish_reason is FinishReason.STOP
        assert final.generated_text == "".join(p.new_text for p in pieces) == "alpha beta "
        assert final.generated_tokens == [t for p in pieces for t in p.new_tokens] == tokens[:keep]
        assert final.generated_log_probs == [-0.5] * keep
        aborted = await received(coordinator)
        assert [(m.header, m.body.client_request_id) for m in aborted] == [(Header.ABORT, "r")]
        coordinator.result("r")  # the fleet's answer to the abort: acknowledged, and nothing else happens
        acked = await received(coordinator)
        assert [m.header for m in acked] == [Header.RESULT_ACK] and client.num_pending == 0


async def _collect(stream) -> list:
    return [item async for item in stream]


async def test_without_a_tokenizer_of_its_own_the_client_loads_the_coordinators(tiny_model, tokenizer):
    tokens = tokenizer.encode("hello world", add_special_tokens=False)
    async with registered({"protocol": PROTOCOL_VERSION, "tokenizer": tiny_model}) as (coordinator, client):
        assert client.tokenizer is not None
        request = asyncio.ensure_future(client.add_request([1, 2, 3], SamplingParams(), request_id="r"))
        await received(coordinator)
        coordinator.send(Header.STEP_TOKENS, {"client_request_ids": ["r"], "deltas": [{"new_tokens": tokens}]})
        coordinator.send(Header.RESULT, {"client_request_id": "r", "request": {
            "request_id": "c/r", "prompt_tokens": [1, 2, 3], "status": "COMPLETED", "finish_reason": "length"}})
        assert (await asyncio.wait_for(request, 10)).generated_text == "hello world"


async def test_a_coordinators_tokenizer_this_machine_cannot_read_leaves_text_empty_and_refuses_stop_strings(tmp_path):
    async with registered({"protocol": PROTOCOL_VERSION, "tokenizer": str(tmp_path / "elsewhere")}) as (_, client):
        assert client.tokenizer is None
        with pytest.raises(ValueError, match="stop strings need this client's tokenizer"):
            client.add_request([1, 2, 3], SamplingParams(stop_words=["x"]))
        assert client.num_pending == 0


@pytest.mark.parametrize("protocol", [3, 5])
async def test_a_coordinator_below_protocol_6_is_not_submitted_to(tokenizer, protocol):
    """From 6 tokens travel only as STEP_TOKENS: an older coordinator would send TOKENS, which this client no longer
    reads. The refusal names both versions."""
    async with registered({"protocol": protocol}, tokenizer=tokenizer) as (_, client):
        with pytest.raises(CoordinatorError, match=f"speaks protocol {protocol}; this client speaks {PROTOCOL_VERSION}") as info:
            client.add_request([1, 2, 3], SamplingParams())
        assert info.value.code == "unsupported" and "coordinators of 6 or later" in str(info.value)
        assert client.num_pending == 0


async def test_a_text_prompt_is_tokenized_here_and_the_fleet_sees_only_its_ids(tokenizer, tmp_path):
    """The caller's process tokenizes: SUBMIT carries the ids (the coordinator tokenizes nothing for this
    client), and the result still has the prompt's text. A client without a tokenizer refuses text prompts
    before sending anything (the coordinator would refuse them: it loads no tokenizer)."""
    text = "hello world"
    async with registered({"protocol": PROTOCOL_VERSION}, tokenizer=tokenizer) as (coordinator, client):
        request = asyncio.ensure_future(client.add_request(text, SamplingParams(), request_id="r"))
        (submit,) = await received(coordinator)
        assert submit.header is Header.SUBMIT and submit.body.prompt == tokenizer.encode(text)
        coordinator.send(Header.RESULT, {"client_request_id": "r", "request": {
            "request_id": "c/r", "prompt": None, "prompt_tokens": submit.body.prompt, "status": "COMPLETED",
            "finish_reason": "length"}})
        result = await asyncio.wait_for(request, 10)
        assert (result.prompt, result.prompt_tokens) == (text, tokenizer.encode(text))
    async with registered({"protocol": PROTOCOL_VERSION, "tokenizer": str(tmp_path / "elsewhere")}) as (coordinator,
                                                                                                        client):
        with pytest.raises(ValueError, match="no tokenizer in this process"):
            client.add_request(text, SamplingParams(), request_id="r")
        assert client.num_pending == 0


async def test_a_step_tokens_message_makes_each_of_its_requests_text_and_stops_one_at_its_stop_string(tokenizer):
    """One STEP_TOKENS carries a step's deltas of several requests; each goes to its own request, and a
    stop string in one of them ends that one alone (the others go on)."""
    words = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    async with registered({"protocol": PROTOCOL_VERSION}, tokenizer=tokenizer) as (coordinator, client):
        stopping = SamplingParams(stop_words=["gamma"], num_tokens_to_generate=64)
        plain = SamplingParams(num_tokens_to_generate=64)
        second: asyncio.Queue = asyncio.Queue()
        client.add_request_streaming_to([1, 2, 3], plain, second, request_id="p")
        first = asyncio.ensure_future(_collect(client.add_request_streaming([1, 2, 3], stopping, request_id="s")))
        submitted: list = []
        while len(submitted) < 2:
            submitted += [m.body.client_request_id for m in await received(coordinator) if m.header is Header.SUBMIT]
        assert sorted(submitted) == ["p", "s"]
        coordinator.send(Header.STEP_TOKENS, {"client_request_ids": ["s", "p"], "deltas": [
            {"new_tokens": words, "request_id": "c/s", "finished": False},  # engine-side fields: ignored
            {"new_tokens": words[:2], "request_id": "c/p", "finished": False}]})
        *_, final = await asyncio.wait_for(first, 10)
        assert final.finish_reason is FinishReason.STOP and final.generated_text == "alpha beta "
        piece = await asyncio.wait_for(second.get(), 10)
        assert piece.new_tokens == words[:2] and piece.new_text == tokenizer.decode(words[:2])
        assert client.num_pending == 1  # the other request goes on
