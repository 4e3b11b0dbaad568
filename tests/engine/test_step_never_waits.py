"""A step that never waits: steady-state steps build no tensor from Python data, grammar and penalty rows
sample every step under overlapped scheduling, and on a GPU a steady-state step never synchronizes.

The batch mixes every kind of row: greedy, temperature with top-p and top-k, seeded, penalised, logit
bias with min_tokens, and a grammar. Steady state: every request admitted, prefilled and sampling;
what a step then writes per request goes into persistent buffers (``step_plan``, ``sampling_state``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine

from ..prompts import PROMPTS

LENGTH = 160  # tokens each request generates: more than the steps counted, so none finishes meanwhile
STEADY_STEPS = 100
_ids = itertools.count()


def mixed_params() -> list[SamplingParams]:
    common = dict(num_tokens_to_generate=LENGTH, ignore_eos=True)
    return [
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, **common),
        SamplingParams(temperature=1.0, seed=1234, **common),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                       **common),
        SamplingParams(temperature=1.0, logit_bias={7: 2.0, 11: -5.0}, min_tokens=4, **common),
        SamplingParams(temperature=0.7, structured_outputs={"regex": "[a-z ]*"}, return_log_probs=True,
                       top_n_logprobs=2, **common),
    ]


def add_all(engine: DynamicInferenceEngine, params: list[SamplingParams]) -> list[DynamicInferenceRequest]:
    requests = [DynamicInferenceRequest(f"r{next(_ids)}", prompt, engine.tokenizer.encode(prompt), sp)
                for prompt, sp in zip(PROMPTS, params)]
    for request in requests:
        engine.add_request(request)
    return requests


def steady(engine: DynamicInferenceEngine, requests: list[DynamicInferenceRequest]) -> None:
    """Step until every request has been prefilled and has sampled (nothing left to admit or bind)."""
    for _ in range(50):
        if engine.load().waiting == 0 and all(len(r.generated_tokens) >= 2 for r in requests):
            return
        engine.step()
    raise AssertionError("the batch never reached steady state")


CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.Tensor.new_tensor}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}


def _python_index(index: object) -> bool:
    """Whether an index holds a Python list (which torch turns into a tensor from Python data)."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(_python_index(part) for part in index)


class PythonDataTensors(TorchFunctionMode):
    """Counts tensors built from Python data: constructors from lists, scalars or arrays, and list indices."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in CONSTRUCTORS or (func in INDEXING and len(args) > 1 and _python_index(args[1])):
            self.calls.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_tensors_built_from_python_data():
    with PythonDataTensors() as counter:
        torch.tensor([1, 2, 3])
        torch.zeros(4)[[0, 2]] = 1.0
        torch.zeros(4)[1:3] = 1.0  # a slice builds nothing
    assert len(counter.calls) == 2


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "serial"])
def test_steady_state_steps_build_no_tensor_from_python_data(tiny_llama, async_scheduling):
    engine = DynamicInferenceEngine.from_model_dir(
        tiny_llama, InferenceConfig(block_size_tokens=16, async_scheduling=async_scheduling))
    with PythonDataTensors() as admission:  # the control: binding requests to their slots builds tensors
        requests = add_all(engine, mixed_params())
        steady(engine, requests)
    assert admission.calls
    before = [len(r.generated_tokens) for r in requests]
    with PythonDataTensors() as counter:
        for _ in range(STEADY_STEPS):
            engine.step()
    assert counter.calls == []
    assert [len(r.generated_tokens) - n for r, n in zip(requests, before)] == [STEADY_STEPS] * len(requests)


def test_grammar_and_penalty_rows_get_a_token_every_step_with_overlap(tiny_llama):
    """Each step hands every request its next token (none sits a step out), and the tokens are the serial loop's."""
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, repetition_penalty=1.3, num_tokens_to_generate=24,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, structured_outputs={"regex": "[a-z ]*"},
                             num_tokens_to_generate=24, ignore_eos=True),
              SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)]
    results = {}
    for async_scheduling in (True, False):
        engine = DynamicInferenceEngine.from_model_dir(
            tiny_llama, InferenceConfig(block_size_tokens=16, async_scheduling=async_scheduling))
        requests = add_all(engine, params)
        steady(engine, requests)
        while not any(r.finished for r in requests):
            outputs = engine.step()
            per_request = {out.request.request_id: len(out.new_tokens) for out in outputs}
            assert per_request == {r.request_id: 1 for r in requests}
        while engine.has_unfinished_requests():
            engine.step()
        results[async_scheduling] = [r.generated_tokens for r in requests]
        assert [len(tokens) for tokens in results[async_scheduling]] == [24, 24, 24]
    assert results[True] == results[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: synchronizations are a GPU matter")
@pytest.mark.parametrize("grammar", [True, False], ids=["every-row", "no-grammar-row"])
def test_a_steady_state_step_never_synchronizes_on_a_gpu(tiny_llama, grammar):
    """``torch.cuda.set_sync_debug_mode("error")`` raises at any op that makes the host wait for the whole
    device or a stream (``item``, ``nonzero``, a copy from or to pageable memory, a stream or device
    synchronization). A step waits only on events: the results of the step before (pinned copies) and the
    host buffers' last copies; the debug mode does not count those, and they are the design.

    The grammar row's one wait (docs/engine.md: its mask needs the token in flight on the host) is such an
    event wait: the step finishes the step before it earlier, while its own forward runs, instead of
    after launching it; it adds no other synchronization, so the whole mix runs under the debug mode.
    The mix without the grammar row runs too, so that a failure says which claim broke: the sampled,
    penalised and biased rows never synchronize (the issue's acceptance), or the grammar row's wait
    turned into a synchronizing operation."""
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16, device="cuda"))
    params = [p for p in mixed_params() if grammar or p.structured_outputs is None]
    assert len(params) == len(mixed_params()) - (0 if grammar else 1)
    requests = add_all(engine, params)
    steady(engine, requests)
    before = [len(r.generated_tokens) for r in requests]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEADY_STEPS):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(r.generated_tokens) - n for r, n in zip(requests, before)] == [STEADY_STEPS] * len(requests)
