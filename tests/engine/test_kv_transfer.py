"""Prefill/decode disaggregation on the engine's side: a prefill engine's blocks, through their wire form, start a
decode engine's request where the prefill stopped, bitwise, computing no prompt token again."""

from __future__ import annotations

import random

import msgspec
import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.kv_blocks import KVBlocks, KVTensor
from megatron_serve.wire.protocol import Header, decode, encode
from megatron_serve.engine.kv import transfer as kv_transfer
from megatron_serve.wire.messages import FROM_COORDINATOR, TO_COORDINATOR

BLOCK = 16
MAX_TOKENS = 12


def engine(model_dir: str, **kwargs):
    return MegatronLLM(model_dir, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=64, max_batch_tokens=256,
                                                  batch_invariant=True, **kwargs)).engine


def params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=max_tokens, ignore_eos=True, return_log_probs=True)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 500) for _ in range(length)] for length in (2 * BLOCK + 5, 3 * BLOCK, 9)]


def finish(served) -> None:
    while served.has_unfinished_requests():
        served.step()


def prefill(model_dir: str) -> tuple[list[DynamicInferenceRequest], list[KVBlocks], int]:
    """Each prompt's first token on a prefill engine, and its blocks as the coordinator receives them."""
    served = engine(model_dir)
    requests = [DynamicInferenceRequest(f"r{i}", "", p, params(1)) for i, p in enumerate(prompts())]
    for request in requests:
        served.add_request(request, {"do_remote_decode": True})
    finish(served)
    wire = [decode(encode(Header.KV_BLOCKS, blocks), TO_COORDINATOR).body for blocks in served.kv_out("e")]
    return requests, wire, served.load().computed_tokens


def decode_from(model_dir: str, firsts: list[DynamicInferenceRequest], blocks: list[KVBlocks]):
    """The requests continued on a decode engine, every part of ``blocks`` arriving first (as the coordinator
    sends them, through their wire form)."""
    served = engine(model_dir)
    for part in blocks:
        served.kv_in(decode(encode(Header.KV_BLOCKS, part), FROM_COORDINATOR).body)
    requests = [DynamicInferenceRequest(r.request_id, "", list(r.prompt_tokens), params(),
                                        generated_tokens=list(r.generated_tokens)) for r in firsts]
    for request in requests:
        served.add_request(request, {"do_remote_prefill": True})
    finish(served)
    return requests, served


def colocated(model_dir: str) -> list[DynamicInferenceRequest]:
    served = engine(model_dir)
    requests = [DynamicInferenceRequest(f"r{i}", "", p, params()) for i, p in enumerate(prompts())]
    for request in requests:
        served.add_request(request)
    finish(served)
    return requests


def test_a_decode_engine_continues_from_the_prefill_engines_blocks_bitwise(tiny_llama):
    expected = colocated(tiny_llama)
    firsts, blocks, prefill_computed = prefill(tiny_llama)
    assert [b.request_id for b in blocks] == [r.request_id for r in firsts]
    assert [b.num_tokens for b in blocks] == [len(p) for p in prompts()]
    assert prefill_computed == sum(map(len, prompts()))
    requests, served = decode_from(tiny_llama, firsts, blocks)
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in expected]
    # (a continuation's log probs are those of the tokens it generates: the first one's came from the prefill)
    assert [r.generated_log_probs for r in requests] == [r.generated_log_probs[1:] for r in expected]
    assert served.load().computed_tokens == len(requests) * (MAX_TOKENS - 1)  # not one prompt token
    counts = served.kv.transfer.counts
    assert counts.transfers["received"] == len(blocks) and counts.bytes["received"] == sum(b.num_bytes for b in blocks)

    # The control: blocks of zeros in place of the prefill's change what the decode engine generates, so the
    # equality above came from the transferred contents, not from a prompt computed again.
    zeros = [msgspec.structs.replace(b, tensors=[KVTensor(t.dtype, t.shape, bytes(len(t.data))) for t in b.tensors])
             for b in blocks]
    wrong, _ = decode_from(tiny_llama, firsts, zeros)
    assert [r.generated_log_probs for r in wrong] != [r.generated_log_probs[1:] for r in expected]


def test_blocks_of_other_weights_are_not_used_and_the_context_is_computed(tiny_llama):
    expected = colocated(tiny_llama)
    firsts, blocks, _ = prefill(tiny_llama)
    stale = [msgspec.structs.replace(b, epoch=b.epoch + 1) for b in blocks]
    requests, served = decode_from(tiny_llama, firsts, stale)
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in expected]
    assert served.load().computed_tokens == sum(map(len, prompts())) + len(requests) * (MAX_TOKENS - 1)
    assert served.kv.transfer.counts.transfers["received"] == 0


def test_only_a_request_that_goes_on_sends_its_blocks(tiny_llama):
    """Cut at its length limit (its first token), a request goes on to decode; one that stopped or was aborted is
    over, and its blocks go nowhere."""
    firsts, _, _ = prefill(tiny_llama)
    served = engine(tiny_llama)
    stop_at_first = SamplingParams(temperature=0.0, num_tokens_to_generate=4, stop_token_ids=firsts[0].generated_tokens)
    requests = [DynamicInferenceRequest("length", "", prompts()[0], params(1)),
                DynamicInferenceRequest("stop", "", prompts()[0], stop_at_first),
                DynamicInferenceRequest("abort", "", prompts()[1], params(4))]
    for request in requests:
        served.add_request(request, {"do_remote_decode": True})
    served.step()
    served.abort_request("abort")
    finish(served)
    assert requests[1].finish_reason.value == "stop" and requests[2].finish_reason.value == "abort"
    assert [b.request_id for b in served.kv_out("e")] == ["length"]
    assert served.kv.transfer.counts.transfers["sent"] == 1


def test_blocks_larger_than_a_part_travel_in_parts_and_arrive_whole(tiny_llama, monkeypatch):
    expected = colocated(tiny_llama)
    pool = engine(tiny_llama).kv_cache
    monkeypatch.setattr(kv_transfer, "MAX_PART_BYTES", 2 * pool.bytes_per_pool_block)  # two blocks a part
    firsts, parts, _ = prefill(tiny_llama)
    assert [(p.request_id, p.first_block, p.part_blocks) for p in parts] == [
        ("r0", 0, 2), ("r0", 2, 1), ("r1", 0, 2), ("r1", 2, 1), ("r2", 0, 1)]
    requests, served = decode_from(tiny_llama, firsts, list(reversed(parts)))  # in any order
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in expected]
    assert served.load().computed_tokens == len(requests) * (MAX_TOKENS - 1)
    missing, served = decode_from(tiny_llama, firsts, [p for p in parts if (p.request_id, p.first_block) != ("r1", 2)])
    assert [r.generated_tokens for r in missing] == [r.generated_tokens for r in expected]
    assert served.kv.transfer.counts.transfers["received"] == 2  # r1 computed its context: a part never came
    assert served.load().computed_tokens == len(prompts()[1]) + len(requests) * (MAX_TOKENS - 1)


def test_a_suspend_before_a_prefilled_request_runs_lets_its_blocks_go_and_it_computes_its_context(tiny_llama):
    """Its blocks die with the pool (a plain suspend): after resume it computes its context, and its tokens are
    the same."""
    expected = colocated(tiny_llama)
    firsts, blocks, _ = prefill(tiny_llama)
    served = engine(tiny_llama)
    for part in blocks:
        served.kv_in(part)
    requests = [DynamicInferenceRequest(r.request_id, "", list(r.prompt_tokens), params(),
                                        generated_tokens=list(r.generated_tokens)) for r in firsts]
    for request in requests:
        served.add_request(request, {"do_remote_prefill": True})
    assert served.load().kv_blocks_free < served.load().kv_blocks_total  # waiting, with its blocks
    served.memory.suspend()
    served.memory.resume()
    finish(served)
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in expected]
    assert served.load().computed_tokens == sum(map(len, prompts())) + len(requests) * (MAX_TOKENS - 1)


@pytest.mark.parametrize("broken, problem", [
    (lambda b: msgspec.structs.replace(b, num_tokens=BLOCK), "holds blocks 0 to 2: 1 blocks of"),
    (lambda b: msgspec.structs.replace(b, first_block=2), "holds blocks 2 to 4"),
    (lambda b: msgspec.structs.replace(b, tensors=[KVTensor("int8", t.shape, t.data) for t in b.tensors]), "dtype"),
    (lambda b: msgspec.structs.replace(b, tensors=[KVTensor(t.dtype, t.shape, t.data[:-1]) for t in b.tensors]),
     "bytes"),
])
def test_malformed_blocks_are_named(tiny_llama, broken, problem):
    _, blocks, _ = prefill(tiny_llama)
    assert blocks[0].problem() is None
    assert problem in broken(blocks[0]).problem()
