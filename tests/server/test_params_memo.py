"""A request's sampling parameters validated once per distinct set (``server/params_memo.py``): what a repeated set
gets is what building it again would give, its own copy, and a refused set is refused every time in the same words."""

from __future__ import annotations

import httpx
import pytest

from megatron_serve.generation_config import GenerationDefaults
from megatron_serve.server import create_app
from megatron_serve.server.params_memo import ParamsMemo
from megatron_serve.wire.sampling_params import SamplingParamError, SamplingParams

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"


def test_a_repeated_set_is_an_equal_copy_with_its_own_lists():
    memo, defaults = ParamsMemo(), GenerationDefaults()
    fields = {"temperature": 0.5, "num_tokens_to_generate": 8, "stop_words": ["x"], "logit_bias": {3: 1.0}}
    first, second = memo.sampling_params(defaults, fields), memo.sampling_params(defaults, dict(fields))
    assert first == second == SamplingParams(**fields)
    assert first is not second
    second.stop_words.append("y")
    second.logit_bias[4] = 2.0
    second.termination_id = [7]
    third = memo.sampling_params(defaults, fields)
    assert (third.stop_words, third.logit_bias, third.termination_id) == (["x"], {3: 1.0}, None)


def test_values_equal_in_python_but_of_other_types_are_other_sets():
    memo, defaults = ParamsMemo(), GenerationDefaults()
    assert type(memo.sampling_params(defaults, {"temperature": 1}).temperature) is int
    assert type(memo.sampling_params(defaults, {"temperature": 1.0}).temperature) is float


def test_other_defaults_are_not_answered_from_the_first_ones():
    memo = ParamsMemo()
    assert memo.sampling_params(GenerationDefaults({"top_k": 5}), {}).top_k == 5
    assert memo.sampling_params(GenerationDefaults(), {}).top_k == SamplingParams().top_k


def test_a_refused_set_is_refused_every_time():
    memo, defaults = ParamsMemo(), GenerationDefaults()
    fields = {"num_tokens_to_generate": 4, "min_tokens": 5}
    for _ in range(2):
        with pytest.raises(SamplingParamError, match="min_tokens must be less than or equal to max_tokens=4, got 5"):
            memo.sampling_params(defaults, fields)


def test_a_full_memo_starts_again():
    memo, defaults = ParamsMemo(size=2), GenerationDefaults()
    for seed in range(5):
        assert memo.sampling_params(defaults, {"seed": seed}).seed == seed
    assert len(memo._known) <= 2


async def test_repeated_requests_get_the_same_parameters_and_a_refusal_stays_one(tokenizer):
    backend = FakeBackend(tokenizer, max_sequence_length=1024)
    app = create_app(backend, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0.5, "stop": ["zz"]}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(2):
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
        refusals = [await http.post("/v1/completions", json={**body, "min_tokens": 4}) for _ in range(2)]
    (_, first), (_, second) = backend.submitted
    assert first == second and first is not second and first.stop_words is not second.stop_words
    assert (first.temperature, first.num_tokens_to_generate, first.stop_words) == (0.5, 3, ["zz"])
    assert [r.status_code for r in refusals] == [400, 400]
    assert refusals[0].json() == refusals[1].json()
    assert "min_tokens must be less than or equal to max_tokens=3, got 4" in refusals[0].json()["error"]["message"]
