"""vLLM's engine-level names as vLLM users import and call them: ``RequestOutputKind``, ``AsyncLLM`` (also from
``megatron_serve.v1.engine.async_llm`` and as ``AsyncLLMEngine``), ``EngineArgs`` and ``AsyncEngineArgs``; what is
not supported is refused naming what is (issue 87). Real engines in this process (direct mode), no fakes."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from megatron_serve import LLM, AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams
from megatron_serve.sampling_params import RequestOutputKind
from megatron_serve.v1.engine.async_llm import AsyncLLM

pytestmark = pytest.mark.timeout(600)


def test_the_names_are_where_vllm_users_import_them_with_vllms_values():
    import megatron_serve  # noqa: PLC0415

    assert megatron_serve.AsyncLLM is AsyncLLM is AsyncLLMEngine and megatron_serve.RequestOutputKind is RequestOutputKind
    assert [(kind.name, kind.value) for kind in RequestOutputKind] == [("CUMULATIVE", 0), ("DELTA", 1),
                                                                        ("FINAL_ONLY", 2)]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="output_kind must be <= 2"):
        SamplingParams(output_kind=3)


def test_engine_args_check_llms_keywords_and_build_the_same_llm(tiny_model):
    args = EngineArgs(model=tiny_model, max_model_len=64, num_gpu_blocks_override=32, enforce_eager=True)
    assert args.max_model_len == 64 and isinstance(AsyncEngineArgs(model=tiny_model), EngineArgs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_modl_len'"):
        EngineArgs(model=tiny_model, max_modl_len=64)
    with LLM(**vars(args)) as llm:
        assert llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].finished
    for call, supported in ((lambda: EngineArgs.add_cli_args(argparse.ArgumentParser()), "megatron-serve serve"),
                            (lambda: EngineArgs.from_cli_args(argparse.Namespace()), "EngineArgs\\(model=...,"),
                            (lambda: args.create_engine_config(), "AsyncLLM.from_engine_args")):
        with pytest.raises(NotImplementedError, match=supported):
            call()


async def test_async_llm_from_engine_args_streams_each_output_kind(tiny_model):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_model, num_gpu_blocks_override=64))
    try:
        def params(kind: RequestOutputKind) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, output_kind=kind)

        cumulative = [out async for out in engine.generate("Hello", params(RequestOutputKind.CUMULATIVE), "c")]
        final = cumulative[-1].outputs[0]
        assert len(cumulative) > 1 and len(final.token_ids) == 8 and final.finish_reason == "length"

        deltas = [out async for out in engine.generate("Hello", params(RequestOutputKind.DELTA), "d")]
        assert len(deltas) > 1 and [out.finished for out in deltas] == [False] * (len(deltas) - 1) + [True]
        pieces = [out.outputs[0] for out in deltas]
        assert [t for piece in pieces for t in piece.token_ids] == final.token_ids  # each token once
        assert "".join(piece.text for piece in pieces) == final.text
        assert [entry for piece in pieces for entry in piece.logprobs] == final.logprobs
        assert all(len(piece.token_ids) < 8 for piece in pieces) and pieces[-1].finish_reason == "length"

        only = [out async for out in engine.generate("Hello", params(RequestOutputKind.FINAL_ONLY), "f")]
        assert len(only) == 1 and only[0].finished and only[0].outputs[0].token_ids == final.token_ids

        urgent = [out async for out in engine.generate("Hello", params(RequestOutputKind.FINAL_ONLY), "p",
                                                         priority=-5)]
        assert urgent[0].outputs[0].request.sampling_params.priority == -5
        with pytest.raises(TypeError, match="does not take trace_headers: it takes the prompt, sampling_params, "
                                            "request_id, lora_request and priority"):
            engine.generate("Hello", params(RequestOutputKind.DELTA), "t", trace_headers={"a": "b"})
        with pytest.raises(ValueError, match="stat_loggers: vLLM's stat logger plugins are not supported"):
            AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_model), stat_loggers=[object()])
        with pytest.raises(NotImplementedError, match="from_engine_args\\(AsyncEngineArgs"):
            AsyncLLM.from_vllm_config(object())
    finally:
        await engine.close()


def test_shutdown_is_a_plain_call_as_in_vllm(tiny_model):
    """vLLM's ``AsyncLLM.shutdown()`` is not a coroutine: called so here it stops the engine too, outside an event
    loop at once and inside one as a task of it."""
    engine = AsyncLLM(tiny_model, num_gpu_blocks_override=32)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        asyncio.run(engine.start())

    async def inside() -> None:
        other = AsyncLLM(tiny_model, num_gpu_blocks_override=32)
        await other.start()
        assert other.shutdown() is None
        await other._shutting_down
        with pytest.raises(RuntimeError, match="was shut down"):
            await other.start()

    asyncio.run(inside())
