"""vLLM's engine-level Python names: ``EngineArgs``, ``AsyncEngineArgs`` and ``AsyncLLM`` (``AsyncLLMEngine``).

Code written for vLLM builds its asyncio engine as ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=...,
tensor_parallel_size=...))`` and streams with ``async for out in engine.generate(prompt, params, request_id)``;
here the same lines build a :class:`~megatron_serve.api.async_llm.MegatronAsyncLLM` from the keywords
``LLM(...)`` takes (:mod:`.vllm_args`: each keyword's meaning, warning or refusal), and ``generate`` honours
``SamplingParams.output_kind`` and ``priority``. Where vLLM offers more than this project (a ``VllmConfig``, stat
loggers, its argument parser, tracing headers), the refusal names what is supported instead.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec

from ..config import InferenceConfig
from ..wire.sampling_params import SamplingParams
from .async_llm import MegatronAsyncLLM
from ..client.generate_call import GenerateCall
from ..client.prompts import PromptInput
from ..client.vllm_args import log_warnings, model_directory, parse_llm_keywords

#: What ``AsyncLLM.generate`` takes besides the prompt, its sampling parameters and its request id.
GENERATE_KEYWORDS = ("lora_request", "priority")


class EngineArgs:
    """vLLM's ``EngineArgs``: the model and ``LLM(...)``'s keywords, checked when built (an unknown or refused one
    is a ``TypeError``/``ValueError`` naming it, as ``LLM`` says). Each keyword reads back as an attribute, and
    ``LLM(**vars(args))`` builds the same engine."""

    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        parse_llm_keywords(kwargs)  # refused now, naming the keyword, rather than when an engine is built
        self.model = model
        self.__dict__.update(kwargs)

    def keywords(self) -> dict[str, Any]:
        """The keywords it was built with, the model excluded."""
        return {name: value for name, value in vars(self).items() if name != "model"}

    @classmethod
    def add_cli_args(cls, parser: Any) -> Any:
        raise NotImplementedError("EngineArgs.add_cli_args is vLLM's argument parser: `megatron-serve serve` takes "
                                  "vLLM's serve flags (docs/vllm-mapping.md); here EngineArgs takes LLM()'s keywords")

    @classmethod
    def from_cli_args(cls, args: Any) -> "EngineArgs":
        raise NotImplementedError("EngineArgs.from_cli_args reads vLLM's argument parser: build "
                                  "EngineArgs(model=..., **LLM()'s keywords) instead")

    def create_engine_config(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("create_engine_config makes vLLM's VllmConfig, which this project has no use "
                                  "for: pass these EngineArgs to AsyncLLM.from_engine_args (or LLM(**vars(args)))")


class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs``: :class:`EngineArgs` for :meth:`AsyncLLM.from_engine_args`."""


class AsyncLLM(MegatronAsyncLLM):
    """vLLM's ``AsyncLLM`` (see the module docstring). ``AsyncLLM(model, **LLM()'s keywords)`` builds one too;
    everything :class:`MegatronAsyncLLM` has (``pause``, ``refit``, ``serve``, ...) is here as well."""

    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        if "vllm_config" in kwargs:
            raise TypeError("AsyncLLM(vllm_config=...) is vLLM's internal constructor: build it with "
                            "AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., ...))")
        parsed = parse_llm_keywords(kwargs)
        log_warnings(parsed)
        self._shutting_down: asyncio.Task | None = None  # what a plain shutdown() started in a running loop
        super().__init__(model_directory(model, parsed.options), InferenceConfig(**parsed.config),
                         use_coordinator=parsed.use_coordinator, num_engines=parsed.num_engines,
                         tokenizer=parsed.options.get("tokenizer"),
                         generation_config=parsed.options.get("generation_config", "auto"))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None) -> "AsyncLLM":
        """vLLM's ``AsyncLLM.from_engine_args``: the engine of ``engine_args``, started on first use."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"from_engine_args takes megatron_serve's AsyncEngineArgs, got "
                            f"{type(engine_args).__name__}")
        if stat_loggers:
            raise ValueError("stat_loggers: vLLM's stat logger plugins are not supported; the engines' statistics "
                             "are on /metrics (vLLM's series names) and in the log line of --disable-log-stats")
        return cls(engine_args.model, **engine_args.keywords())

    @classmethod
    def from_vllm_config(cls, *args: Any, **kwargs: Any) -> "AsyncLLM":
        raise NotImplementedError("AsyncLLM.from_vllm_config takes vLLM's VllmConfig: build it with "
                                  "AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., ...))")

    def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,  # type: ignore[override]
                 request_id: str | None = None, *, lora_request: Any = None, priority: int = 0,
                 **unsupported: Any) -> GenerateCall:
        """vLLM's ``AsyncLLM.generate``: ``async for`` its ``RequestOutput``s (``sampling_params.output_kind``);
        ``priority`` as in vLLM (lower runs first; with ``--scheduling-policy priority`` it preempts).
        vLLM's other keywords are refused by name, with what is taken (:data:`GENERATE_KEYWORDS`)."""
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given:
            raise TypeError(f"AsyncLLM.generate() does not take {', '.join(given)}: it takes the prompt, "
                            f"sampling_params, request_id, {' and '.join(GENERATE_KEYWORDS)}")
        if priority:
            params = sampling_params if sampling_params is not None else self.generation_defaults.sampling_params()
            sampling_params = msgspec.structs.replace(params, priority=priority)
            sampling_params.validate()  # the priority's range, named
        return super().generate(prompt, sampling_params, request_id, lora_request=lora_request)

    async def abort(self, request_id: str | list[str]) -> None:
        """vLLM's ``abort``: end these requests (one id or a list); their streams finish with ``abort``."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self.client.abort(one)

    def shutdown(self, timeout: float | None = None) -> None:  # type: ignore[override]
        """vLLM's ``shutdown``, a plain call: the engine in this process is released, or the fleet this object
        started stops (in a running event loop, as a task of it; ``await`` :meth:`close` or
        :meth:`MegatronAsyncLLM.shutdown` to wait for it)."""
        ending = self.close() if self.engine is not None else MegatronAsyncLLM.shutdown(self)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(ending)
            return
        self._shutting_down = loop.create_task(ending)  # held: a task nobody holds may be collected mid-way


AsyncLLMEngine = AsyncLLM  # vLLM's top-level name for it (``from vllm import AsyncLLMEngine``)
