"""A client's resubmission after a reconnect gets what it missed once, also when steps overtake it.

The client counts its tokens when it resubmits; the coordinator reads that count later, after it has forwarded
the steps that ran since its ``HELLO_ACK``, and its catch-up repeats them. The catch-up says where it starts
and the client keeps what lies past its own tokens. Without that a stream of the chaos test carried its first
5 tokens twice. A step forwarded to the old socket is lost with it: the new connection first gets every request's
tokens from the first (``start`` 0), so that what follows continues what the client has (without it a chaos run's
stream had a step's token in the place of one lost, and a result delivered at the HELLO lacked its last tokens).
Driven through the coordinator's core and the client's own pending-request table.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import msgspec
import pytest

from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.client.pending_requests import PendingRequest, PendingRequests
from megatron_serve.wire.messages import Submit, TokenDelta, delta_past
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.sampling_params import SamplingParams

from .core_harness import CoreHarness
from .test_core import final_record, step

OLD, NEW, ENGINE = b"client-old-socket", b"client-new-socket", b"engine-1"


def _pending(loop: asyncio.AbstractEventLoop, params: SamplingParams) -> PendingRequest:
    return PendingRequest("r", [1, 2, 3], params, True, loop.create_future(),
                          OutputCollector("r", [1, 2, 3], params, None), asyncio.Queue())


@contextlib.contextmanager
def _started(tokens: int) -> Iterator[tuple[CoreHarness, PendingRequests, str, dict]]:
    """A client on its old socket with request ``r`` (``tokens`` to generate) dispatched to an engine: the harness,
    the client's table, the engine id, the request as the engine got it (on an event loop closed after)."""
    h = CoreHarness()
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(num_tokens_to_generate=tokens)
        pending = PendingRequests()
        pending.add(_pending(loop, params))
        h.client(OLD)
        engine = h.engine(ENGINE)
        h.send(OLD, Header.SUBMIT, Submit(client_request_id="r", prompt=[1, 2, 3], stream=True,
                                          sampling_params=msgspec.Raw(msgspec.msgpack.encode(params))))
        yield h, pending, engine, h.take(ENGINE, Header.ENGINE_SUBMIT)[0].request
    finally:
        loop.close()


def _streamed_after_an_overtaken_resubmission(keep_start: bool) -> list[int]:
    """Tokens 11, 12 before the reconnect; 13 forwarded between the HELLO_ACK and the resubmission (which counted
    2 tokens); 14 last. What the client's stream carried."""
    with _started(4) as (h, pending, engine, submitted):
        stream = pending.get("r").queue

        def receive(identity: bytes, strip: bool = False) -> None:
            for body in h.take(identity, Header.STEP_TOKENS):
                pending.on_delta(body.client_request_id, body, None if strip else body.start)

        step(h, ENGINE, engine, "c1/r", [11])
        step(h, ENGINE, engine, "c1/r", [12])
        receive(OLD)
        h.client(NEW)  # the client replaced a silent socket: the same client id says HELLO again
        # encoded as the HELLO_ACK is read (2 tokens), as the client's send does
        resubmission = msgspec.msgpack.decode(msgspec.msgpack.encode(pending.get("r").submit_body()), type=Submit)
        step(h, ENGINE, engine, "c1/r", [13])  # forwarded to the new socket, read before the catch-up
        receive(NEW)
        h.send(NEW, Header.SUBMIT, resubmission)
        receive(NEW, strip=not keep_start)  # the catch-up
        step(h, ENGINE, engine, "c1/r", [14], finished=True, record=final_record(submitted, [11, 12, 13, 14]))
        receive(NEW)
        streamed = []
        while not stream.empty():
            streamed += stream.get_nowait().new_tokens
        return streamed


def test_a_resubmission_overtaken_by_a_step_gets_each_token_once():
    assert _streamed_after_an_overtaken_resubmission(keep_start=True) == [11, 12, 13, 14]


def test_a_catch_up_read_without_its_start_repeats_the_overtaking_step():
    """The control: the catch-up really overlaps what the client had."""
    assert _streamed_after_an_overtaken_resubmission(keep_start=False) == [11, 12, 13, 13, 14]


def _streamed(pending_request: PendingRequest) -> list[int]:
    tokens = []
    while not pending_request.queue.empty():
        item = pending_request.queue.get_nowait()
        tokens += getattr(item, "new_tokens", [])
    return tokens


def test_a_step_lost_with_the_old_socket_comes_before_the_steps_on_the_new_one():
    """Tokens 11, 12 read on the old socket; 13 forwarded to it and lost when the client replaced it; 14 forwarded
    to the new socket before the resubmission (which counted 2 tokens) arrives; 15 last."""
    with _started(5) as (h, pending, engine, submitted):
        request = pending.get("r")
        step(h, ENGINE, engine, "c1/r", [11])
        step(h, ENGINE, engine, "c1/r", [12])
        h.deliver(OLD, pending)
        step(h, ENGINE, engine, "c1/r", [13])
        h.inbox.pop(OLD)  # lost with the old socket
        h.client(NEW)
        resubmission = msgspec.msgpack.decode(msgspec.msgpack.encode(request.submit_body()), type=Submit)
        step(h, ENGINE, engine, "c1/r", [14])
        h.deliver(NEW, pending)
        h.send(NEW, Header.SUBMIT, resubmission)
        step(h, ENGINE, engine, "c1/r", [15], finished=True, record=final_record(submitted, [11, 12, 13, 14, 15]))
        h.deliver(NEW, pending)
        assert request.future.done()
        assert _streamed(request) == request.future.result().generated_tokens == [11, 12, 13, 14, 15]


def test_a_result_delivered_at_the_hello_comes_after_the_tokens_lost_with_the_old_socket():
    """The last step (12) and the RESULT went to the old socket and were lost; the new HELLO delivers the result."""
    with _started(2) as (h, pending, engine, submitted):
        request = pending.get("r")
        step(h, ENGINE, engine, "c1/r", [11])
        h.deliver(OLD, pending)
        step(h, ENGINE, engine, "c1/r", [12], finished=True, record=final_record(submitted, [11, 12]))
        h.inbox.pop(OLD)  # lost with the old socket
        h.client(NEW)
        h.deliver(NEW, pending)
        assert request.future.done()
        assert _streamed(request) == request.future.result().generated_tokens == [11, 12]


@pytest.mark.parametrize(("have", "kept"), [(4, [13, 14, 15]), (5, [14, 15]), (7, None), (3, [12, 13, 14, 15])])
def test_a_catch_up_is_cut_where_the_client_has_tokens_and_its_lists_with_it(have, kept):
    """Tokens 12-15 from index 3, of which 12 came with a resubmission (no log prob, no epochs of its own)."""
    catch_up = TokenDelta(new_tokens=[12, 13, 14, 15], new_log_probs=[-1.3, -1.4, -1.5],
                          epochs=[[0, 0, 1], [0, 1, 1], [-1, -1, -1]], top_ids=[[13], [14], [15]],
                          top_log_probs=[[-1.3], [-1.4], [-1.5]], top_p_token_ids=[[13, 2], [14], [15, 3]])
    past = delta_past(catch_up, 3, have)
    if kept is None:
        assert past is None
        return
    assert past.new_tokens == kept
    n = min(len(kept), 3)
    assert past.new_log_probs == [-1.3, -1.4, -1.5][-n:] and past.top_ids == [[13], [14], [15]][-n:]
    assert past.top_p_token_ids == [[13, 2], [14], [15, 3]][-n:]
    assert past.epochs == [[0, 0, 1][-n:], [0, 1, 1][-n:], [-1, -1, -1][-n:]]


def test_deltas_of_steps_are_never_cut():
    """Only a catch-up says where it starts: a step's delta (no start) is all new, however many tokens the client
    has."""
    pending = PendingRequests()
    loop = asyncio.new_event_loop()
    try:
        pending.add(_pending(loop, SamplingParams(num_tokens_to_generate=8)))
        pending.on_delta("r", TokenDelta(new_tokens=[4, 5]))
        pending.on_delta("r", TokenDelta(new_tokens=[6]))
        assert pending.get("r").collector.tokens == [4, 5, 6]
        pending.on_delta("r", TokenDelta(new_tokens=[5, 6, 7]), 1)  # the control: a catch-up from index 1 is cut
        assert pending.get("r").collector.tokens == [4, 5, 6, 7]
    finally:
        loop.close()
