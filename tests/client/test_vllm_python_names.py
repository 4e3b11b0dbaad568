"""vLLM's Python names: ``SamplingParams(max_tokens=..., n=..., stop=..., logprobs=...)``, ``MegatronLLM.chat``,
and ``finish_reason`` that is a plain string wherever vLLM code looks at one.

Before this work ``SamplingParams(max_tokens=8)`` and ``SamplingParams(n=2)`` raised ``TypeError``,
``MegatronLLM.chat`` did not exist, and ``f"{finish_reason}"`` gave ``FinishReason.STOP`` on Python 3.11.
"""

from __future__ import annotations

import json

import msgpack
import msgspec
import pytest

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.request import DynamicInferenceRequest, FinalRecord, FinishReason
from megatron_serve.wire.sampling_params import params_from_wire

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_vllm_names_set_ours_and_read_back():
    params = SamplingParams(max_tokens=8, stop="END", logprobs=3, top_k=-1, seed=4, n=2, min_tokens=1,
                            stop_token_ids=[7], presence_penalty=0.5)
    assert (params.num_tokens_to_generate, params.stop_words, params.return_log_probs, params.top_n_logprobs) == (
        8, ["END"], True, 3)
    assert (params.max_tokens, params.stop, params.logprobs, params.prompt_logprobs) == (8, ["END"], 3, None)
    assert params.top_k == 0 and params.n == 2  # vLLM's -1 is our 0: off
    scored = SamplingParams(prompt_logprobs=2, logprobs=1)
    assert scored.return_prompt_log_probs and scored.top_n_logprobs == 2 and scored.prompt_logprobs == 2
    guided = SamplingParams(guided_decoding={"choice": ["a", "b"]})
    assert guided.structured_outputs.choice == ["a", "b"]
    assert SamplingParams(max_tokens=5, num_tokens_to_generate=5).num_tokens_to_generate == 5  # the same value agrees
    # the wire knows only our names
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(max_tokens=8, stop=["x"])))
    assert wire == {"num_tokens_to_generate": 8, "stop_words": ["x"]}


@pytest.mark.parametrize("kwargs,names", [
    ({"max_tokens": 8, "num_tokens_to_generate": 9}, ("max_tokens", "num_tokens_to_generate")),
    ({"stop": "a", "stop_words": ["b"]}, ("stop", "stop_words")),
    ({"logprobs": 5, "top_n_logprobs": 2}, ("logprobs", "top_n_logprobs")),
    ({"logprobs": 1, "return_log_probs": False}, ("logprobs", "return_log_probs")),
    ({"best_of": 2}, ("best_of",)),
    ({"n": 0}, ("n",)),
    ({"priority": 2**40}, ("priority",)),
    ({"cache_salt": ""}, ("cache_salt",)),
    ({"truncate_prompt_tokens": 0}, ("truncate_prompt_tokens",)),
])
def test_contradictions_and_unknown_names_are_value_errors_naming_the_fields(kwargs, names):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert all(name in str(error.value) for name in names)


def test_a_wire_request_runs_one_whole_sequence():
    for params in (SamplingParams(n=2), SamplingParams(truncate_prompt_tokens=4)):
        with pytest.raises(ValueError, match="one request runs one sequence"):
            params_from_wire(msgspec.msgpack.encode(params))
    salted = SamplingParams(priority=-3, cache_salt="t1")
    assert params_from_wire(msgspec.msgpack.encode(salted))[0] == salted  # these travel


def test_finish_reason_is_a_plain_string_everywhere_vllm_code_looks():
    reason = FinishReason.STOP
    assert reason == "stop" and "stop" == reason and {"stop": 1}[reason] == 1 and reason in ("stop", "length")
    assert (str(reason), f"{reason}", f"{reason:>6}", "%s" % reason, format(reason)) == (
        "stop", "stop", "  stop", "stop", "stop")
    assert json.dumps({"finish_reason": reason}) == '{"finish_reason": "stop"}'
    assert msgpack.unpackb(msgpack.packb(reason)) == "stop"
    request = DynamicInferenceRequest("r", "p", [1, 2], finish_reason=FinishReason.LENGTH)
    final = msgspec.msgpack.decode(msgspec.msgpack.encode(request.final_record()), type=FinalRecord)
    assert final.finish_reason == "length" and msgpack.unpackb(msgspec.msgpack.encode(final))["finish_reason"] == "length"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with MegatronLLM(tiny_llama, InferenceConfig(num_kv_blocks=128)) as llm:
        yield llm


def test_chat_renders_the_template_with_tools_and_kwargs(llm):
    tokenizer = llm.tokenizer
    conversation = [{"role": "user", "content": "What is the weather like?"}]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    (answer,) = llm.chat(conversation, greedy, tools=TOOLS)
    rendered = tokenizer.apply_chat_template(conversation, tools=TOOLS)
    assert answer.prompt == rendered and "<tools>" in rendered and '"get_weather"' in rendered
    assert answer.prompt_tokens == tokenizer.encode(rendered, add_special_tokens=False)
    (direct,) = llm.generate([answer.prompt_tokens], greedy)
    assert answer.generated_tokens == direct.generated_tokens and answer.finish_reason == "length"
    batch = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Sunny"}]], greedy,
                     add_generation_prompt=False, continue_final_message=False)
    assert [r.prompt for r in batch] == [tokenizer.apply_chat_template(c, add_generation_prompt=False)
                                         for c in (conversation, conversation + [{"role": "assistant",
                                                                                 "content": "Sunny"}])]
    with pytest.raises(ValueError, match="images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], greedy)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "robot", "content": "hi"}], greedy)


def test_n_seeds_lists_and_truncation(llm):
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    outs = llm.generate(["Hello", "The quick brown fox"], sampled)
    assert len(outs) == 6 and [o.prompt for o in outs] == ["Hello"] * 3 + ["The quick brown fox"] * 3
    # one seed, a stream per choice (keyed on seed, sample index and position), as over HTTP
    assert [(o.sampling_params.seed, o.sampling_params.sample_index) for o in outs[:3]] == [(11, 0), (11, 1), (11, 2)]
    again = llm.generate("Hello", sampled)  # a list of n, even for one prompt
    assert [o.generated_tokens for o in again] == [o.generated_tokens for o in outs[:3]]
    per_prompt = llm.generate(["Hello", "Hi"], [SamplingParams(max_tokens=2, temperature=0),
                                               SamplingParams(max_tokens=5, temperature=0)])
    assert [len(o.generated_tokens) for o in per_prompt] == [2, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["Hello", "Hi"], [SamplingParams()])
    text = "The quick brown fox jumps over the lazy dog"
    tail = llm.tokenizer.encode(text)[-4:]
    (cut,) = llm.generate(text, SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=4))
    (direct,) = llm.generate([tail], SamplingParams(max_tokens=4, temperature=0))
    assert cut.prompt_tokens == tail and cut.generated_tokens == direct.generated_tokens


VLLM_SCRIPT = """
from vllm import LLM
from vllm.inputs import TokensPrompt, TextPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput, CompletionOutput
from vllm.sampling_params import SamplingParams, StructuredOutputsParams, GuidedDecodingParams

assert LoRARequest("a", 1, "/x").lora_name == "a"
assert GuidedDecodingParams is StructuredOutputsParams
assert TokensPrompt(prompt_token_ids=[1, 2])["prompt_token_ids"] == [1, 2] and TextPrompt(prompt="hi")["prompt"] == "hi"
params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
assert params.num_tokens_to_generate == 2 and RequestOutput and CompletionOutput and LLM
"""


def test_a_vllm_scripts_imports_work_with_the_package_name_replaced():
    """Issue 65: ``vllm.inputs``, ``vllm.lora.request``, ``vllm.outputs`` and ``vllm.sampling_params`` have
    namesakes, so replacing ``vllm`` by ``megatron_serve`` in a script is enough (they raised ImportError)."""
    exec(compile(VLLM_SCRIPT.replace("vllm", "megatron_serve"), "vllm_script", "exec"), {})
