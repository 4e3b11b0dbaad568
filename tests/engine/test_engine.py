"""Engine behaviour: preemption, chunked prefill, sampling, stop conditions, admission errors, events."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import msgspec
import pytest

from megatron_serve import (
    DynamicInferenceRequest,
    EventType,
    FinishReason,
    InferenceConfig,
    MegatronLLM,
    RequestStatus,
    SamplingParams,
)

from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.engine.output import step_delta
from megatron_serve.wire.messages import RequestDelta
from megatron_serve.wire.request import FinalRecord

from ..prompts import PROMPTS, run_steps, run_to_end

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True, return_log_probs=True)


@pytest.fixture(scope="module")
def reference_outputs(tiny_llama):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=16))
    return [o.generated_tokens for o in llm.generate(PROMPTS * 4, GREEDY)]


def test_preemption_under_a_tiny_pool_keeps_outputs(tiny_llama, reference_outputs):
    # 32 requests of ~20-60 tokens each, 12 blocks of 4 tokens: constant preemption.
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=4, num_kv_blocks=24, max_batch_tokens=64))
    outs = llm.generate(PROMPTS * 4, GREEDY)
    preemptions = sum(1 for o in outs for e in o.events if e.type is EventType.PREEMPT)
    assert preemptions > 10
    assert all(o.status is RequestStatus.COMPLETED for o in outs)
    assert [o.generated_tokens for o in outs] == reference_outputs
    assert llm.engine.load().kv_blocks_free == llm.engine.load().kv_blocks_total


def test_a_request_preempted_while_its_step_is_in_flight_reports_the_epoch_its_token_was_computed_under(
        tiny_llama, reference_outputs):
    # Overlapped scheduling preempts a sequence while the step that samples its next token is still in
    # flight; that token's KV generation is the one at launch. An unset one (None) once made the
    # coordinator drop the whole step's message: tokens went missing from fleet results.
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(
        block_size_tokens=4, num_kv_blocks=24, max_batch_tokens=64, async_scheduling=True))
    requests = [DynamicInferenceRequest(request_id=str(i), prompt=p, prompt_tokens=engine.tokenizer.encode(p),
                                        sampling_params=GREEDY) for i, p in enumerate(PROMPTS * 4)]
    for request in requests:
        engine.add_request(request)
    wire, tokens = msgspec.msgpack.Decoder(RequestDelta), {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = wire.decode(msgspec.msgpack.encode(step_delta(out)))  # as the coordinator reads it
            assert delta.epochs is None or all(isinstance(e, int) for e in delta.epochs[1]), delta.epochs
            tokens[delta.request_id] += delta.new_tokens
    assert sum(1 for r in requests for e in r.events if e.type is EventType.PREEMPT) > 10
    assert [tokens[r.request_id] for r in requests] == reference_outputs
    assert all(isinstance(e, int) for r in requests for e in r.kv_epochs)


def test_chunked_prefill_with_small_token_budget_keeps_outputs(tiny_llama, reference_outputs):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=8, max_batch_tokens=7, max_requests=3))
    outs = llm.generate(PROMPTS * 4, GREEDY)
    assert [o.generated_tokens for o in outs] == reference_outputs


def test_top_k_one_equals_greedy(tiny_llama, reference_outputs):
    llm = MegatronLLM(tiny_llama)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, num_tokens_to_generate=24, ignore_eos=True))
    assert [o.generated_tokens for o in outs] == reference_outputs[: len(PROMPTS)]


def test_seeded_sample_is_the_same_alone_or_in_a_batch(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, num_tokens_to_generate=20, ignore_eos=True, seed=7)
    alone = llm.generate(PROMPTS[1], params)[0].generated_tokens
    batch = llm.generate(PROMPTS, params)[1].generated_tokens
    tight = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=4, num_kv_blocks=20))
    preempted = tight.generate(PROMPTS, params)[1].generated_tokens
    assert alone == batch == preempted
    other_seed = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, num_tokens_to_generate=20,
                                                        ignore_eos=True, seed=8))[0].generated_tokens
    assert other_seed != alone


def test_sampling_explores_more_than_greedy(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    outs = llm.generate([PROMPTS[0]] * 6, SamplingParams(temperature=1.5, num_tokens_to_generate=12, ignore_eos=True))
    assert len({tuple(o.generated_tokens) for o in outs}) > 1


def test_stop_word_ends_generation_and_is_trimmed(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, num_tokens_to_generate=40, ignore_eos=True))[0]
    text = free.generated_text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, num_tokens_to_generate=40, ignore_eos=True,
                                                  stop_words=[stop]))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.generated_text == text[: text.find(stop)]
    assert stop not in out.generated_text
    tokenizer = llm.tokenizer  # ends at the token that completed the stop string, which the text leaves out
    keep = next(k for k in range(1, 41) if stop in tokenizer.decode(free.generated_tokens[:k]))
    assert out.generated_tokens == free.generated_tokens[:keep]
    deadline = time.monotonic() + 30  # the engine thread drops it after the caller has its answer
    while llm.engine.has_unfinished_requests() or llm.engine.load().kv_blocks_free != llm.engine.load().kv_blocks_total:
        assert time.monotonic() < deadline, "the engine kept a request that a stop string ended"
        time.sleep(0.01)
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, num_tokens_to_generate=40, ignore_eos=True,
                                                   stop_words=[stop], include_stop_str_in_output=True))[0]
    assert kept.generated_text == text[: text.find(stop) + len(stop)] and kept.generated_tokens == out.generated_tokens


def test_special_tokens_are_skipped_unless_asked_not_to(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    eos = llm.tokenizer.eos_token_ids[0]
    forced = dict(temperature=0.0, num_tokens_to_generate=3, ignore_eos=True, logit_bias={eos: 100.0})
    skipped = llm.generate(PROMPTS[0], SamplingParams(**forced))[0]
    shown = llm.generate(PROMPTS[0], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert skipped.generated_tokens == shown.generated_tokens == [eos] * 3
    assert skipped.generated_text == "" and shown.generated_text == llm.tokenizer.token_text(eos) * 3


def test_termination_id_stops_and_ignore_eos_keeps_it(tiny_llama, reference_outputs):
    llm = MegatronLLM(tiny_llama)
    expected = reference_outputs[0]
    stop_token = expected[5]
    first = expected.index(stop_token)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, num_tokens_to_generate=24,
                                                  termination_id=stop_token))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.generated_tokens == expected[:first + 1]  # the stop token last, as in vLLM


def run_alone_and_together(engine: DynamicInferenceEngine, prompts: list, params: SamplingParams) -> list:
    """Every prompt through ``engine`` in the same steps (the Python API refuses bad ones before they get here:
    tests/client/test_generate_refusals.py); the finished requests, in order."""
    tokenizer = engine.tokenizer
    requests = [DynamicInferenceRequest(f"r{i}", None, tokenizer.encode(p) if isinstance(p, str) else p, params)
                for i, p in enumerate(prompts)]
    return run_to_end(engine, requests)


def test_over_long_prompt_fails_alone(tiny_llama):
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(max_sequence_length=64))
    long_prompt = list(range(5, 105))
    outs = run_alone_and_together(engine, [PROMPTS[0], long_prompt, PROMPTS[3]],
                                  SamplingParams(temperature=0.0, num_tokens_to_generate=8))
    assert outs[1].status is RequestStatus.FAILED
    assert outs[1].finish_reason is FinishReason.ERROR
    assert "100 tokens" in outs[1].error and "max_sequence_length is 64" in outs[1].error
    assert outs[0].status is outs[2].status is RequestStatus.COMPLETED


def test_generation_is_capped_at_max_sequence_length(tiny_llama):
    llm = MegatronLLM(tiny_llama, InferenceConfig(max_sequence_length=30))
    prompt = llm.tokenizer.encode(PROMPTS[1])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, num_tokens_to_generate=50, ignore_eos=True))[0]
    assert len(prompt) + len(out.generated_tokens) == 30
    assert out.finish_reason is FinishReason.LENGTH


def test_bad_token_ids_and_empty_prompts_fail_alone(tiny_llama):
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama)
    outs = run_alone_and_together(engine, [[1, 2, 10**6], [], PROMPTS[0]], SamplingParams(num_tokens_to_generate=4))
    assert "outside the vocabulary" in outs[0].error
    assert outs[1].error == "prompt is empty"
    assert outs[2].status is RequestStatus.COMPLETED


def test_stop_token_ids_outside_the_vocabulary_fail_alone(tiny_llama):
    """A stop id past the vocabulary is refused at admission (it reached the engine's vocabulary-wide mask before,
    sized by the largest id); the other requests of the step run."""
    llm = MegatronLLM(tiny_llama)
    bad = SamplingParams(num_tokens_to_generate=4, stop_token_ids=[3, 10**6], presence_penalty=0.5)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [bad, SamplingParams(num_tokens_to_generate=4)])
    assert outs[0].status is RequestStatus.FAILED and "stop_token_ids names token id 1000000" in outs[0].error
    assert outs[1].status is RequestStatus.COMPLETED


def test_top_n_logprobs_contain_the_chosen_token(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True,
                                                  return_log_probs=True, top_n_logprobs=3))[0]
    assert len(out.generated_top_n_logprobs) == 6
    for token, log_prob, top in zip(out.generated_tokens, out.generated_log_probs, out.generated_top_n_logprobs):
        assert len(top) == 3
        assert top[token] == pytest.approx(log_prob)
        assert max(top.values()) == pytest.approx(log_prob)


def test_events_timing_and_msgpack_round_trip(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, num_tokens_to_generate=5, ignore_eos=True,
                                                  return_log_probs=True, top_n_logprobs=2))[0]
    kinds = [e.type for e in out.events]
    assert kinds[:3] == [EventType.ADD, EventType.PREFILL, EventType.FIRST_TOKEN] and kinds[-1] is EventType.FINISH
    assert 0 <= out.ttft <= out.latency
    final = msgspec.msgpack.decode(msgspec.msgpack.encode(out.final_record()), type=FinalRecord)
    assert final == out.final_record() and final.events == out.events
    assert (final.first_token_time - final.arrival_time, final.finish_time - final.arrival_time, final.finish_reason,
            final.status) == (out.ttft, out.latency, "length", out.status)


def test_a_record_with_an_unknown_status_is_refused_naming_the_field():
    record = {"request_id": "r", "status": "COMPLETED", "finish_reason": "length"}
    decode = msgspec.msgpack.Decoder(FinalRecord).decode
    assert decode(msgspec.msgpack.encode(record)).finish_reason is FinishReason.LENGTH
    with pytest.raises(msgspec.ValidationError, match=r"'DONE' - at `\$.status`"):
        decode(msgspec.msgpack.encode({**record, "status": "DONE"}))
    with pytest.raises(msgspec.ValidationError, match=r"`\$.finish_reason`"):
        decode(msgspec.msgpack.encode({**record, "finish_reason": 7}))


def test_prompt_shapes_and_input_order(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)
    tokens = llm.tokenizer.encode(PROMPTS[1])
    by_text = llm.generate(PROMPTS[1], params)
    by_tokens = llm.generate(tokens, params)
    batch = llm.generate([PROMPTS[0], PROMPTS[1]], params)
    assert len(by_text) == len(by_tokens) == 1
    assert by_text[0].generated_tokens == by_tokens[0].generated_tokens == batch[1].generated_tokens
    assert batch[0].prompt == PROMPTS[0]
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate(["ok", 3.5], params)


def test_a_dropped_megatron_llm_stops_its_threads_and_frees_its_engine(tiny_llama):
    threads_before = set(threading.enumerate())
    llm = MegatronLLM(tiny_llama)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True)
    assert llm.generate(PROMPTS[0], params)[0].status is RequestStatus.COMPLETED  # its engine thread runs
    status = llm.status()  # direct mode: the engine's own counters
    assert status["completed"] == 1 and status["engines"][0]["kv_blocks_total"] == llm.engine.load().kv_blocks_total
    engine = weakref.ref(llm.engine)
    del llm  # never closed
    deadline = time.monotonic() + 30
    while gc.collect() is not None and (alive := engine()) is not None:
        holders = sorted({type(holder).__qualname__ for holder in gc.get_referrers(alive)} - {"frame", "list"})
        assert time.monotonic() < deadline, f"the engine (and its KV pool) outlived the MegatronLLM: held by {holders}"
        del alive
        time.sleep(0.05)
    # Its own threads (event loop, engine) end; threads other tests or libraries left are not its.
    deadline = time.monotonic() + 30
    while left := [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]:
        assert time.monotonic() < deadline, f"threads of the dropped MegatronLLM still run: {left}"
        time.sleep(0.05)


def test_lifecycle_verbs_raise_in_direct_mode(tiny_llama):
    llm = MegatronLLM(tiny_llama)
    for verb in ("pause", "unpause", "suspend", "resume", "shutdown"):
        with pytest.raises(RuntimeError, match="coordinator mode"):
            getattr(llm, verb)()


def test_suspend_releases_the_pool_and_resume_continues(tiny_llama, reference_outputs):
    llm = MegatronLLM(tiny_llama)
    engine = llm.engine
    requests = [DynamicInferenceRequest(str(i), p, llm.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS)]
    run_steps(engine, requests, 5)
    engine.sync()  # the step in flight (overlapped scheduling) delivers its tokens before the verb
    expected_bytes = engine.kv_cache.num_bytes
    assert engine.memory.suspend() == expected_bytes > 0
    assert engine.step() == [] and engine.load().running == 0
    engine.memory.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.generated_tokens for r in requests] == reference_outputs[: len(PROMPTS)]
    assert any(e.type is EventType.EVICT for e in requests[0].events)


def test_handed_back_requests_continue_on_another_engine(tiny_llama, reference_outputs):
    first, second = MegatronLLM(tiny_llama).engine, MegatronLLM(tiny_llama).engine
    requests = [DynamicInferenceRequest(str(i), p, first.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS)]
    run_steps(first, requests, 6)
    handed = first.take_unfinished_requests()
    assert handed and not first.has_unfinished_requests()
    assert first.load().kv_blocks_free == first.load().kv_blocks_total
    run_to_end(second, handed)
    assert [r.generated_tokens for r in requests] == reference_outputs[: len(PROMPTS)]


def test_abort_frees_blocks(tiny_llama):
    engine = MegatronLLM(tiny_llama).engine
    request = DynamicInferenceRequest("a", None, [5, 6, 7, 8], GREEDY)
    engine.add_request(request)
    engine.step()
    assert engine.load().kv_blocks_free < engine.load().kv_blocks_total
    assert engine.abort_request("a") is request
    assert request.finish_reason is FinishReason.ABORT
    assert engine.load().kv_blocks_free == engine.load().kv_blocks_total and not engine.has_unfinished_requests()
    assert engine.abort_request("a") is None


def test_degenerate_sampling_values_decode_greedily_instead_of_failing(tiny_llama, reference_outputs):
    llm = MegatronLLM(tiny_llama)
    for params in (SamplingParams(temperature=1e-300, num_tokens_to_generate=24, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_p=5e-324, num_tokens_to_generate=24, ignore_eos=True)):
        outs = llm.generate(PROMPTS[:2], params)
        assert [o.generated_tokens for o in outs] == reference_outputs[:2]
