"""LoRA through the Python API and the engine flags: vLLM's ``LoRARequest`` and ``LLM`` keywords, the
``--enable-lora``/``--lora-modules``/``--max-lora*`` flags, and their round trip to engine processes."""

from __future__ import annotations

import argparse

import pytest

from megatron_serve import LLM, InferenceConfig, LoRARequest, SamplingParams
from megatron_serve.client.vllm_options import _lora_module
from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
from megatron_serve.fleet.argv import inference_config_to_argv

from ..lora_adapters import make_peft_adapter
from ..prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("api-adapters")
    return [str(make_peft_adapter(tiny_llama, root / f"a{i}", rank=4 * (i + 1), seed=i)) for i in range(2)]


def test_llm_generate_with_lora_requests(tiny_llama, adapters):
    with LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2) as llm:
        assert (llm.engine.config.max_loras, llm.engine.config.max_lora_rank) == (2, 8)
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
        first = LoRARequest("first", 1, adapters[0])
        second = LoRARequest("second", 2, adapters[1])
        tuned = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                                                                lora_request=first)]
        mixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                                                                lora_request=[first, None])]
        assert tuned != base, "control: the adapter changes the tokens"
        assert mixed == [tuned[0], base[1]]
        other = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=second)[0].outputs[0].token_ids
        assert other != tuned[0]
        with pytest.raises(ValueError, match="lora_request holds 1 LoRARequests for 2 prompts"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[first])
        failed = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 3, ""))
        assert "LoRA adapter 'missing' is not loaded" in str(failed[0].outputs[0].request.error)


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/x")


def test_an_engine_without_enable_lora_refuses_adapter_requests(tiny_llama, adapters):
    with LLM(tiny_llama) as llm:  # as vLLM's LLM: a ValueError, nothing sent
        with pytest.raises(ValueError, match="Got lora_request 'a' but LoRA is not enabled!"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters[0]))


def test_lora_flags_round_trip_through_engine_argv(adapters):
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    original = InferenceConfig(device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=32,
                               max_cpu_loras=5, lora_modules={"a": adapters[0], "b=c": adapters[1]})
    rebuilt = inference_config_from_args(parser.parse_args(inference_config_to_argv(original)))
    assert rebuilt.to_dict() == original.to_dict()


def test_lora_modules_take_both_of_vllms_forms():
    assert _lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    assert _lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "m"}') == ("sql", "/a/sql")
    for bad in ("sql", "=/a", '{"name": "sql"}', '{"name": "x", "path": "/a", "rank": 4}', "{oops"):
        with pytest.raises(argparse.ArgumentTypeError):
            _lora_module(bad)


@pytest.mark.parametrize("config, message", [
    (dict(max_loras=0), "max_loras must be a positive integer"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be at least max_loras \(4\)"),
    (dict(lora_modules={"a": "/x"}), "lora_modules needs enable_lora"),
])
def test_bad_lora_settings_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        InferenceConfig(device="cpu", **config)


def test_add_lora_remove_lora_and_list_loras_as_vllms(tiny_llama, adapters):
    from megatron_serve.client.coordinator_client import ControlError  # noqa: PLC0415

    with LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=4, max_cpu_loras=2) as llm:
        by_path = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("first", 1, adapters[0]))[0].outputs[0].token_ids
        llm.remove_lora("first")
        assert llm.list_loras() == set()
        assert llm.add_lora(LoRARequest("again", 2, adapters[0])) is True
        assert llm.list_loras() == {"again"}
        by_name = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("again", 2))[0].outputs[0].token_ids
        assert by_name == by_path  # the same adapter, registered by add_lora instead of a request's path
        with pytest.raises(ControlError, match="rank 8 is above --max-lora-rank 4") as err:
            llm.add_lora(LoRARequest("wide", 3, adapters[1]))
        assert err.value.code == "lora_refused" and llm.list_loras() == {"again"}
        with pytest.raises(ControlError, match="'gone' is not loaded") as err:
            llm.remove_lora("gone")
        assert err.value.code == "lora_not_found"
        with pytest.raises(ValueError, match="add_lora needs a LoRARequest with a lora_path"):
            llm.add_lora(LoRARequest("nopath", 4))
