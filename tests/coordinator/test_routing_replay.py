"""Routing replay across a move: a request that leaves its engine keeps the routing its tokens were made with.

The coordinator's core alone (no sockets) first: rows mirrored with the tokens, carried by the next
dispatch and by a result the coordinator writes itself. Then end to end: real engines on a tiny
Qwen3-MoE model behind a real coordinator (in threads, over real sockets). The first engine hangs
mid-generation; the stall timeout moves the request to a second engine, which must continue from
the rows the coordinator mirrored: it receives them with the request, computes only the positions
after them, and the final ``routing_indices`` equal a run on one engine, with no row missing or
repeated.
"""

from __future__ import annotations

import asyncio
import threading

import msgspec
import numpy as np
import pytest

from megatron_serve import InferenceConfig, MegatronLLM
from megatron_serve.client.coordinator_client import StreamPartial
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.wire.expert_routing import routing_from_wire, routing_to_wire
from megatron_serve.wire.messages import ClientAbort, EngineStep, RoutingRows, RequestDelta, Submit
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.request import EngineRequest, EventType, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from .core_harness import CoreHarness

pytestmark = pytest.mark.timeout(300)

PROMPT = [12, 40, 7, 99, 250, 31, 8, 77, 64, 5, 18]
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True, return_routing_indices=True)
CONFIG = InferenceConfig(dtype="float32", block_size_tokens=8, num_kv_blocks=16)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("moe"), seed=2, arch="qwen3_moe"))


def hang_after(engine: DynamicInferenceEngine, steps: int) -> tuple[threading.Event, threading.Event]:
    """``engine`` blocks in its step after ``steps`` steps until released; (hanging, release) events."""
    hanging, release = threading.Event(), threading.Event()
    step, done = engine.step, [0]

    def step_then_hang():
        if done[0] >= steps:
            hanging.set()
            release.wait()
        done[0] += 1
        return step()

    engine.step = step_then_hang
    return hanging, release


def arrivals(engine: DynamicInferenceEngine) -> list:
    """Every request ``engine`` receives, as (generated tokens, routing rows) at arrival."""
    seen: list = []
    add = engine.add_request

    def record(request: EngineRequest, kv_transfer_params: dict | None = None):
        seen.append((list(request.generated_tokens), None if request.routing_indices is None
                     else request.routing_indices.array()))
        add(request, kv_transfer_params)

    engine.add_request = record
    return seen


async def test_moved_request_keeps_its_mirrored_routing(fleet_factory, moe_model):
    with MegatronLLM(moe_model, CONFIG) as llm:  # its engine thread ends with it
        expected = llm.generate([PROMPT], PARAMS)[0]
    fleet = fleet_factory(stall_timeout=1.0)
    first = DynamicInferenceEngine.from_model_dir(moe_model, CONFIG)
    hanging, release = hang_after(first, 8)  # the prompt's step, then seven decode steps
    fleet.add_engine(fake=first, heartbeat_interval=0.1)
    try:
        async with fleet.connected(1) as client:
            streamed: list[int] = []

            async def consume():
                async for item in client.add_request_streaming(PROMPT, PARAMS, request_id="moved"):
                    if isinstance(item, StreamPartial):
                        streamed.extend(item.new_tokens)
                    else:
                        return item

            task = asyncio.create_task(consume())
            assert await asyncio.to_thread(hanging.wait, 30), "the first engine never reached its ninth step"
            second = DynamicInferenceEngine.from_model_dir(moe_model, CONFIG)
            received = arrivals(second)
            fleet.add_engine(fake=second, heartbeat_interval=0.1)
            final = await asyncio.wait_for(task, 60)
    finally:
        release.set()

    assert final.status is RequestStatus.COMPLETED and any(e.type is EventType.EVICT for e in final.events)
    assert final.generated_tokens == expected.generated_tokens and streamed == final.generated_tokens
    np.testing.assert_array_equal(final.routing_indices, expected.routing_indices)
    assert final.routing_indices.shape[0] == len(PROMPT) + PARAMS.num_tokens_to_generate - 1
    [(generated_at_move, mirrored)] = received
    # the tokens the first engine delivered in its eight steps: with overlapped scheduling the eighth step's
    # token was still on the device when the engine hung, and the next engine computes it again
    assert len(generated_at_move) == (7 if CONFIG.async_scheduling else 8)
    # the rows of every token the first engine processed came along, and the final record starts with them
    assert mirrored.shape[0] == len(PROMPT) + len(generated_at_move) - 1
    np.testing.assert_array_equal(final.routing_indices[: len(mirrored)], mirrored)


def _routing_step(h: CoreHarness, engine_id: str, tokens: list[int], start: int, rows: np.ndarray) -> None:
    out = RequestDelta(request_id="c1/r", new_tokens=tokens, finished=False,
                     routing=RoutingRows(start=start, **routing_to_wire(rows)))
    h.send(b"e1", Header.ENGINE_STEP,
           EngineStep(engine_id=engine_id, outputs=[msgspec.Raw(msgspec.msgpack.encode(out))]))


def test_core_mirrors_rows_into_the_next_dispatch_and_a_result_it_finishes():
    """The pure core: rows arrive with the tokens, an out-of-order delivery is dropped (tokens kept), a
    moved request's ENGINE_SUBMIT carries every mirrored row, and the client gets every step's rows
    with its tokens (a RESULT the coordinator writes itself, an abort, does not repeat them)."""
    rows = (np.arange(12, dtype=np.uint8) % 8).reshape(6, 1, 2)  # 6 positions, 1 MoE layer, top-2
    h = CoreHarness()
    h.client(b"client")
    e1 = h.engine(b"e1", group=0, capacity=1)
    params = msgspec.msgpack.encode({"num_tokens_to_generate": 8, "return_routing_indices": True})
    h.send(b"client", Header.SUBMIT,
           Submit(client_request_id="r", prompt=[1, 2, 3, 4], sampling_params=msgspec.Raw(params)))
    assert "routing_indices" not in h.take(b"e1", Header.ENGINE_SUBMIT)[0].request
    _routing_step(h, e1, [7], 0, rows[:4])  # the prompt's four positions
    _routing_step(h, e1, [8], 9, rows[4:5])  # a gap: not mirrored
    _routing_step(h, e1, [9], 4, rows[4:6])
    assert h.core.flow.table.get("c1/r").generated_tokens == [7, 8, 9]
    h.engine(b"e2", group=1, capacity=1)
    h._perform(h.core.on_peer_gone(b"e1", "connection closed", h.now))
    moved = h.take(b"e2", Header.ENGINE_SUBMIT)[0].request
    np.testing.assert_array_equal(routing_from_wire(moved["routing_indices"]), rows)
    sent = [t.routing for t in h.take(b"client", Header.STEP_TOKENS)]
    assert [r.start for r in sent] == [0, 9, 4]  # as the engine sent them: the client keeps what continues
    h.send(b"client", Header.ABORT, ClientAbort(client_request_id="r"))
    result = h.take(b"client", Header.RESULT)[0].request
    assert result["finish_reason"] == "abort" and "routing_indices" not in result
