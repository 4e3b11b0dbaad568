"""Prefill/decode disaggregation in the coordinator's core: a new request to a prefill engine with its first
token only, its blocks kept and sent to a decode engine ahead of it, and sent again when that engine is lost
before they landed."""

from __future__ import annotations


from megatron_serve.wire.kv_blocks import KVBlocks, KVTensor
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness
from .test_core import C, final_record, status, step, submit

P, D1, D2 = b"prefill", b"decode-1", b"decode-2"


def blocks(request_id: str, engine_id: str, tokens: int = 3, first_block: int = 0) -> KVBlocks:
    return KVBlocks(request_id=request_id, engine_id=engine_id, epoch=0, block_size=16, num_tokens=tokens,
                    tensors=[KVTensor("bfloat16", (1, 2), b"abcd")], first_block=first_block)


def decode_got(h: CoreHarness, identity: bytes) -> tuple[list[KVBlocks], object]:
    """What a decode engine got: the blocks, then the request (in that order, and nothing else)."""
    got = h.take(identity)
    assert [type(body).__name__ for body in got] == ["KVBlocks"] * (len(got) - 1) + ["EngineSubmit"], got
    return got[:-1], got[-1]


def fleet(h: CoreHarness, decodes: tuple[bytes, ...] = (D1,)) -> tuple[str, list[str]]:
    h.client(C)
    prefill = h.engine(P, group=0, kv_role="kv_producer")
    return prefill, [h.engine(d, group=1 + i, kv_role="kv_consumer") for i, d in enumerate(decodes)]


def prefilled(h: CoreHarness, prefill: str, request_id: str = "c1/r", first: int = 7) -> dict:
    """The prefill engine's part: what it was sent; then its blocks and its step ending the request there."""
    sent = h.take(P, Header.ENGINE_SUBMIT)
    assert len(sent) == 1
    h.send(P, Header.KV_BLOCKS, blocks(request_id, prefill, tokens=20, first_block=1))
    step(h, P, prefill, request_id, [first], finished=True, record=final_record(sent[0].request, [first]))
    return sent[0]


def test_a_new_request_is_prefilled_for_its_first_token_then_decoded_from_its_blocks():
    h = CoreHarness()
    prefill, (decode,) = fleet(h)
    submit(h, "r", tokens=4, stream=True)
    assert not h.take(D1, Header.ENGINE_SUBMIT)
    h.send(P, Header.KV_BLOCKS, blocks("c1/r", prefill, tokens=20))  # a request's blocks may come in parts
    sent = prefilled(h, prefill)
    assert sent.kv_transfer_params == {"do_remote_decode": True}
    assert sent.request["sampling_params"] == {"num_tokens_to_generate": 1}  # the first token only
    assert [t.new_tokens for t in h.take(C, Header.STEP_TOKENS)] == [[7]]  # streamed at once
    assert not h.take(C, Header.RESULT)  # not the request's end
    parts, handed = decode_got(h, D1)
    assert parts == [blocks("c1/r", prefill, 20), blocks("c1/r", prefill, 20, 1)]
    assert handed.request["generated_tokens"] == [7]
    assert handed.kv_transfer_params == {"do_remote_prefill": True, "remote_engine_id": prefill}
    assert handed.request["sampling_params"] == {"num_tokens_to_generate": 4}  # the client's, whole
    step(h, D1, decode, "c1/r", [8])
    assert h.core.flow.handoffs.blocks == {}  # landed: no longer kept
    step(h, D1, decode, "c1/r", [9, 10], finished=True, record=final_record(handed.request, [7, 8, 9, 10]))
    assert [t.new_tokens for t in h.take(C, Header.STEP_TOKENS)] == [[8], [9, 10]]
    assert [r.request["generated_tokens"] for r in h.take(C, Header.RESULT)] == [[7, 8, 9, 10]]
    assert h.core.flow.handoffs.handed_on == 1 and status(h).completed == 1


def test_a_decode_engine_lost_before_the_blocks_landed_leaves_them_for_the_next():
    h = CoreHarness()
    prefill, decodes = fleet(h, (D1, D2))
    submit(h, "r", tokens=4)
    prefilled(h, prefill)
    first = D1 if h.inbox.get(D1) else D2
    other = D2 if first == D1 else D1
    parts, _ = decode_got(h, first)
    assert not h.take(other)
    h.gone.add(first)
    h._perform(h.core.on_peer_gone(first, "connection closed", h.now))
    again_parts, again = decode_got(h, other)
    assert again.request["generated_tokens"] == [7] and again.kv_transfer_params["do_remote_prefill"]
    assert again_parts == parts == [blocks("c1/r", prefill, 20, 1)]  # the same blocks, sent again
    assert not h.take(P, Header.ENGINE_SUBMIT)  # and no second prefill


def test_a_request_over_at_its_first_token_ends_on_the_prefill_engine():
    h = CoreHarness()
    prefill, _ = fleet(h)
    submit(h, "r", tokens=4)
    sent = h.take(P, Header.ENGINE_SUBMIT)[0]
    h.send(P, Header.KV_BLOCKS, blocks("c1/r", prefill))
    record = {**final_record(sent.request, []), "finish_reason": "stop"}  # its first token was a stop token
    step(h, P, prefill, "c1/r", [], finished=True, record=record)
    assert not h.take(D1, Header.ENGINE_SUBMIT)
    assert [r.request["finish_reason"] for r in h.take(C, Header.RESULT)] == ["stop"]
    assert h.core.flow.handoffs.blocks == {} and h.core.flow.handoffs.prefilling == {}


def test_a_one_token_request_is_served_whole_by_its_prefill_engine():
    h = CoreHarness()
    fleet(h)
    submit(h, "r", tokens=1)
    sent = h.take(P, Header.ENGINE_SUBMIT)[0]
    assert sent.kv_transfer_params is None and h.core.flow.handoffs.prefilling == {}


def test_blocks_from_an_engine_that_was_not_prefilling_the_request_are_dropped_by_name(caplog):
    h = CoreHarness()
    prefill, (decode,) = fleet(h)
    submit(h, "r", tokens=4)
    h.send(D1, Header.KV_BLOCKS, blocks("c1/r", decode))
    h.send(P, Header.KV_BLOCKS, blocks("c1/r", "an-older-registration"))
    h.send(P, Header.KV_BLOCKS, blocks("c1/r", prefill, tokens=40, first_block=5))
    assert h.core.flow.handoffs.blocks == {} and h.core.drop.total == 3
    for reason in ("which it was not prefilling", "stale KV_BLOCKS", "holds blocks 5 to 5: 3 blocks of 16 tokens hold 40 tokens"):
        assert reason in caplog.text


def test_without_prefill_engines_the_decode_engines_serve_requests_whole_and_the_other_way_round():
    h = CoreHarness()
    h.client(C)
    h.engine(D1, group=1, kv_role="kv_consumer")
    submit(h, "r", tokens=4)
    sent = h.take(D1, Header.ENGINE_SUBMIT)[0]
    assert sent.kv_transfer_params is None and sent.request["sampling_params"] == {"num_tokens_to_generate": 4}
    alone = CoreHarness()
    alone.client(C)
    prefill = alone.engine(P, group=0, kv_role="kv_producer")
    submit(alone, "r", tokens=4)
    prefilled(alone, prefill)
    itself = alone.take(P)  # no decode engine: the prefill engine goes on itself, from the tokens
    assert len(itself) == 1 and itself[0].request["generated_tokens"] == [7] and itself[0].kv_transfer_params is None


def test_a_colocated_fleet_is_untouched():
    h = CoreHarness()
    h.client(C)
    h.engine(D1, group=0)
    submit(h, "r", tokens=4)
    sent = h.take(D1, Header.ENGINE_SUBMIT)[0]
    assert sent.kv_transfer_params is None and not h.core.flow.handoffs.active
