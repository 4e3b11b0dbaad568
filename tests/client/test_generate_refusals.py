"""``generate`` and ``chat`` raise ``ValueError`` for what the engines would refuse, as vLLM's ``LLM`` does.

Before (issue 54) each of these came back as a finished request with ``finish_reason`` ``"error"``
and empty text, the reason hidden in ``outputs[0].request.events[-1].detail``: a prompt longer than
``max_model_len``, a token id outside the vocabulary, an empty prompt, a ``lora_request`` without
``enable_lora``, a LoRA directory that is not there. A batch with one such prompt raises before
any of it runs (the engine's counters do not move); the good prompts of the control run.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from megatron_serve import LLM, LoRARequest, MegatronAsyncLLM, SamplingParams
from megatron_serve.config import InferenceConfig

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, max_model_len=MAX_MODEL_LEN, enforce_eager=True) as llm:
        yield llm


def submitted(llm: LLM) -> int:
    status = llm.status()
    return status["completed"] + status["failed"] + status["aborted"]


def refusals(vocab: int, tmp_path) -> list[tuple[dict, str]]:
    """``generate`` keywords that vLLM refuses, with what its ``ValueError`` says."""
    return [
        (dict(prompts=[[5] * MAX_MODEL_LEN]),
         rf"The decoder prompt \(length {MAX_MODEL_LEN}\) plus the number of requested output tokens \(at least 1\) "
         rf"is longer than the maximum model length of {MAX_MODEL_LEN}"),
        (dict(prompts=["Hello", "word " * 200]),
         rf"The decoder prompt \(length \d+\) \(prompt 1\) is longer than the maximum model length of "
         rf"{MAX_MODEL_LEN}\. Make sure that `max_model_len`"),
        (dict(prompts=[[5, 6, vocab]]), rf"Token id {vocab} is out of vocabulary \(the model's vocabulary is "
                                        rf"\[0, {vocab}\)\)"),
        (dict(prompts=[[5, -1]]), r"Token id -1 is out of vocabulary"),
        (dict(prompts=["Hello", []]), r"The decoder prompt cannot be empty \(prompt 1\)"),
        (dict(prompts=["Hello"], lora_request=LoRARequest("tuned", 1, str(tmp_path))),
         r"Got lora_request 'tuned' but LoRA is not enabled!"),
    ]


def test_generate_raises_what_vllm_raises_and_sends_nothing(llm, tmp_path):
    vocab = llm.engine.model.config.vocab_size
    before = submitted(llm)
    for keywords, message in refusals(vocab, tmp_path):
        with pytest.raises(ValueError, match=message):
            llm.generate(sampling_params=GREEDY, use_tqdm=False, **keywords)
    assert submitted(llm) == before  # the good prompts of each batch did not run either
    (out,) = llm.generate([[5] * (MAX_MODEL_LEN - 1)], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)  # control: one token of room is enough
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    assert submitted(llm) == before + 1


def test_chat_raises_for_a_conversation_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=rf"is longer than the maximum model length of {MAX_MODEL_LEN}"):
        llm.chat([{"role": "user", "content": "word " * 200}], GREEDY, use_tqdm=False)
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_a_missing_lora_directory_is_named(tiny_llama, tmp_path):
    missing = tmp_path / "no-such-adapter"
    with LLM(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=8, enforce_eager=True) as llm:
        with pytest.raises(ValueError, match=rf"lora_request 'tuned': the LoRA directory {missing} does not exist"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False, lora_request=LoRARequest("tuned", 1, str(missing)))
        with pytest.raises(ValueError, match=rf"the LoRA directory {tmp_path} holds no adapter_config\.json"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False, lora_request=LoRARequest("tuned", 1, str(tmp_path)))


def test_the_async_api_raises_the_same_awaited_and_streamed(tiny_llama, caplog):
    async def main() -> None:
        config = InferenceConfig(device="cpu", dtype="float32", max_sequence_length=MAX_MODEL_LEN, num_kv_blocks=2,
                                 block_size_tokens=16)
        async with MegatronAsyncLLM(tiny_llama, config) as llm:
            with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
                await llm.generate([[]], GREEDY)
            with pytest.raises(ValueError, match=rf"maximum model length of {MAX_MODEL_LEN}"):
                async for _ in llm.generate([7] * 100, GREEDY, request_id="r"):
                    pass
            with pytest.raises(ValueError, match="is out of vocabulary"):
                async for _ in llm.generate_stream([10 ** 6], GREEDY):
                    pass
            # what no check foresees is logged: a request that needs more KV blocks than the pool holds
            with caplog.at_level(logging.WARNING, logger="megatron_serve.client"):
                result = await llm.generate([5, 6], SamplingParams(temperature=0.0, max_tokens=40))
            assert result.finish_reason == "error"
            assert [r.getMessage() for r in caplog.records] == [f"request {result.request_id} failed: {result.error}"]
            assert "KV blocks" in result.error

    asyncio.run(main())
