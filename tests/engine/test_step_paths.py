"""The engine's execution paths give the same tokens: piecewise-replayed mixed steps vs eager steps, and the
overlapped step loop vs the serial one.

Workloads arrive while the engine steps (requests admitted nearly every step, as under online traffic), so
most steps mix prefill chunks with decodes; a small token budget splits prompts into chunks, a tiny KV pool
forces preemption, shared prefixes hit the prefix cache. On CPU the mixed graphs run through the stand-in
capture of ``tests.graph_replay``: the same persistent buffers, padding and pieces as on a GPU, with
attention run eagerly between the pieces.
"""

from __future__ import annotations

import itertools

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.request import FinishReason
from megatron_serve.wire.sampling_params import StructuredOutputsParams
from megatron_serve.model.tiny import make_tiny_model

from ..graph_replay import install_graphs
from ..prompts import PROMPTS

BLOCK = 8
SHARED = "A shared system prompt that many requests start with, long enough to fill blocks: "
_ids = itertools.count()


def config(**overrides) -> InferenceConfig:
    return InferenceConfig(**{"block_size_tokens": BLOCK, "max_requests": 8, "max_batch_tokens": 40, **overrides})


def arrivals(prompts: list[str], params: list[SamplingParams], every: int = 1) -> list[tuple[int, str, SamplingParams]]:
    """Request ``i`` arrives before step ``i * every``."""
    return [(i * every, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def drive(llm: MegatronLLM, schedule: list[tuple[int, str, SamplingParams]],
          abort_at: dict[int, int] | None = None) -> list[DynamicInferenceRequest]:
    """Add each request before its step, abort ``abort_at[step] = request index`` before that step, step until done."""
    engine = llm.engine
    requests = [DynamicInferenceRequest(f"r{next(_ids)}", p, llm.tokenizer.encode(p), sp) for _, p, sp in schedule]
    abort_at = abort_at or {}
    for step in itertools.count():
        for (at, _, _), request in zip(schedule, requests):
            if at == step:
                engine.add_request(request)
        if step in abort_at:
            engine.abort_request(requests[abort_at[step]].request_id)
        if step > max(at for at, _, _ in schedule) and not engine.has_unfinished_requests():
            return requests
        engine.step()


def tokens(requests: list[DynamicInferenceRequest]) -> list[list[int]]:
    return [r.generated_tokens for r in requests]


GREEDY = [SamplingParams(temperature=0.0, num_tokens_to_generate=6 + 3 * (i % 4), ignore_eos=True)
          for i in range(len(PROMPTS))]
MIXED_WORKLOAD = arrivals(PROMPTS + [SHARED + p for p in PROMPTS[:4]], GREEDY + GREEDY[:4])


@pytest.fixture(scope="module")
def eager_run(tiny_llama) -> list[list[int]]:
    return tokens(drive(MegatronLLM(tiny_llama, config()), MIXED_WORKLOAD))


def test_mixed_steps_replayed_piecewise_equal_eager_steps(tiny_llama, eager_run):
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [1, 2, 4, 8], mixed_sizes=[8, 16, 24, 32, 40])
    got = tokens(drive(llm, MIXED_WORKLOAD))
    assert got == eager_run
    pieces = len(llm.engine.model.model.layers) + 1
    mixed = [size for size in capture.replayed_sizes if size in (16, 24, 32, 40)]
    assert len(mixed) >= 3 * pieces  # steps that mixed prefill chunks with decodes replayed, padded up


def test_mixed_graphs_with_preemption_and_the_prefix_cache(tiny_llama):
    small = config(num_kv_blocks=12)
    eager = tokens(drive(MegatronLLM(tiny_llama, small), MIXED_WORKLOAD))
    llm = MegatronLLM(tiny_llama, small)
    install_graphs(llm.engine, [1, 2, 4, 8], mixed_sizes=[8, 16, 40])
    requests = drive(llm, MIXED_WORKLOAD)
    assert tokens(requests) == eager
    assert any(e.type.value == "PREEMPT" for r in requests for e in r.events)


def test_steps_over_the_largest_mixed_graph_run_eagerly(tiny_llama, eager_run):
    llm = MegatronLLM(tiny_llama, config())
    capture = install_graphs(llm.engine, [1, 2], mixed_sizes=[8])
    assert tokens(drive(llm, MIXED_WORKLOAD)) == eager_run
    assert set(capture.replayed_sizes) <= {1, 2, 8}


def test_moe_mixed_graphs_record_the_same_routing(tmp_path):
    model_dir = str(make_tiny_model(tmp_path / "moe", seed=3, arch="qwen3_moe"))
    params = [SamplingParams(temperature=0.0, num_tokens_to_generate=5 + i, ignore_eos=True,
                             return_routing_indices=True) for i in range(4)]
    schedule = arrivals(PROMPTS[:4], params)
    eager = drive(MegatronLLM(model_dir, config()), schedule)
    llm = MegatronLLM(model_dir, config())
    capture = install_graphs(llm.engine, [1, 2, 4], mixed_sizes=[8, 16, 40])
    replayed = drive(llm, schedule)
    assert tokens(replayed) == tokens(eager)
    for ours, theirs in zip(replayed, eager):
        assert ours.routing_indices.tolist() == theirs.routing_indices.tolist()
    assert {16, 40} & set(capture.replayed_sizes)


# ------------------------------------------------------------------------- overlapped vs serial step loop


def eos_after(llm: MegatronLLM, prompt: str, n: int) -> int:
    """A token the model emits as its ``n``-th greedy token for ``prompt``: a stop token that ends it early."""
    out = llm.generate([prompt], SamplingParams(temperature=0.0, num_tokens_to_generate=n, ignore_eos=True))[0]
    return out.generated_tokens[n - 1]


def varied_workload(llm: MegatronLLM) -> list[tuple[int, str, SamplingParams]]:
    """Every per-request feature whose handling depends on when the host sees a token."""
    stop_token = eos_after(llm, PROMPTS[1], 4)
    jobs = [
        SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True),
        SamplingParams(temperature=0.0, num_tokens_to_generate=12, termination_id=stop_token),  # stops by token
        SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, num_tokens_to_generate=10, ignore_eos=True),
        SamplingParams(temperature=0.0, num_tokens_to_generate=10, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.5, repetition_penalty=1.3),  # reads its tokens on the host
        SamplingParams(temperature=0.0, num_tokens_to_generate=9, ignore_eos=True, return_log_probs=True,
                       top_n_logprobs=3, return_prompt_log_probs=True),
        SamplingParams(temperature=0.0, num_tokens_to_generate=8, termination_id=stop_token, min_tokens=6),
        SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,12}")),
        SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, logit_bias={5: 4.0}),
        SamplingParams(temperature=0.8, seed=11, num_tokens_to_generate=8, ignore_eos=True, min_p=0.05),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(jobs))]
    return arrivals(prompts, jobs)


def outcome(requests: list[DynamicInferenceRequest]) -> list[tuple]:
    return [(r.generated_tokens, r.generated_text, r.finish_reason, r.generated_log_probs,
             r.generated_top_n_logprobs, r.prompt_log_probs) for r in requests]


@pytest.mark.parametrize("budget", [40, 2048])
def test_overlapped_loop_equals_serial_loop(tiny_llama, budget):
    serial = MegatronLLM(tiny_llama, config(async_scheduling=False, max_batch_tokens=budget))
    overlapped = MegatronLLM(tiny_llama, config(async_scheduling=True, max_batch_tokens=budget))
    schedule = varied_workload(serial)
    want, got = drive(serial, schedule), drive(overlapped, schedule)
    for ours, theirs in zip(outcome(got), outcome(want)):
        assert ours[:3] == theirs[:3]
        assert ours[3] == pytest.approx(theirs[3], abs=1e-5) and ours[5] == pytest.approx(theirs[5], abs=1e-5)
    assert {r.finish_reason for r in want} == {FinishReason.STOP, FinishReason.LENGTH}
    assert len(want[1].generated_tokens) < 12  # the stop token came


def test_stop_strings_end_overlapped_requests_as_serial_ones(tiny_llama):
    """Stop strings are found where the text is made (the client side); the engine is told to drop the request
    while it may have a step in flight for it. Text and tokens equal the serial loop's."""
    serial = MegatronLLM(tiny_llama, config(async_scheduling=False))
    greedy = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)
    texts = [o.generated_text for o in serial.generate(PROMPTS[:4], greedy)]
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True,
                            stop_words=[text[6:9] for text in texts])
    want = serial.generate(PROMPTS[:4], params)
    got = MegatronLLM(tiny_llama, config(async_scheduling=True)).generate(PROMPTS[:4], params)
    assert [(o.generated_tokens, o.generated_text, o.finish_reason) for o in got] == \
        [(o.generated_tokens, o.generated_text, o.finish_reason) for o in want]
    assert all(o.finish_reason is FinishReason.STOP and len(o.generated_tokens) < 12 for o in want)


def test_overlapped_loop_with_aborts_preemption_and_graphs_equals_serial(tiny_llama):
    small = config(num_kv_blocks=12)
    schedule = MIXED_WORKLOAD
    serial = drive(MegatronLLM(tiny_llama, config(num_kv_blocks=12, async_scheduling=False)), schedule,
                   abort_at={5: 2, 9: 0})
    llm = MegatronLLM(tiny_llama, small)
    install_graphs(llm.engine, [1, 2, 4, 8], mixed_sizes=[8, 16, 40])
    overlapped = drive(llm, schedule, abort_at={5: 2, 9: 0})
    assert [r.finish_reason for r in overlapped] == [r.finish_reason for r in serial]
    kept = [i for i, r in enumerate(serial) if r.finish_reason is not FinishReason.ABORT]
    assert [overlapped[i].generated_tokens for i in kept] == [serial[i].generated_tokens for i in kept]
    assert llm.engine.load().kv_blocks_free == llm.engine.load().kv_blocks_total  # every block came back


def test_verbs_between_overlapped_steps_lose_nothing(tiny_llama, tmp_path):
    """Suspend, resume and refit (to the same weights) between steps; the step in flight is finished first."""
    params = [SamplingParams(temperature=0.0, num_tokens_to_generate=14, ignore_eos=True)] * 4
    want = tokens(drive(MegatronLLM(tiny_llama, config(async_scheduling=False)), arrivals(PROMPTS[:4], params)))
    llm = MegatronLLM(tiny_llama, config())
    engine = llm.engine
    requests = [DynamicInferenceRequest(f"v{i}", p, llm.tokenizer.encode(p), sp)
                for i, (p, sp) in enumerate(zip(PROMPTS[:4], params))]
    delivered = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)

    def step_n(n: int, call=None) -> None:
        for _ in range(n):
            for out in (call or engine.step)():
                delivered[out.request.request_id] += out.new_tokens

    step_n(4)
    step_n(1, engine.sync)
    engine.memory.suspend()
    step_n(2)  # suspended: nothing runs
    engine.memory.resume()
    step_n(3)
    engine.memory.refit(tiny_llama)  # finishes the step in flight: its tokens come out of the next step
    while engine.has_unfinished_requests():
        step_n(1)
    assert tokens(requests) == want
    assert [delivered[r.request_id] for r in requests] == want  # every token delivered once, in order
