"""``MegatronAsyncLLM``: the asyncio Python API (docs/python-api.md).

Written once against the engine-client interface (:mod:`megatron_serve.client.engine_client`), whose
implementation is chosen when the object is built:

* **direct** (``use_coordinator=False``): one engine in this process, stepped by a thread of its
  own (:class:`~megatron_serve.client.local_engine.LocalEngineClient`) so that the event loop never blocks
  on the model. The lifecycle verbs raise ``RuntimeError``; ``refit`` loads new weights between
  two steps (requests in flight continue on them and their per-token epochs show the switch).
* **coordinator** (``use_coordinator=True``): the coordinator client
  (:class:`~megatron_serve.api.fleet_client.FleetClient`). Without ``coordinator_address`` it starts
  its own coordinator and ``num_engines`` engine processes and stops them on :meth:`shutdown`; with
  an address it connects to that fleet and :meth:`shutdown` only disconnects (it never stops a
  fleet it did not start; send :meth:`stop` for that).

``async with`` starts the object and on exit calls :meth:`close`. :meth:`serve` serves it over HTTP in this process
(:func:`megatron_serve.server.serve_async_llm`, imported when called: FastAPI loads only where something serves).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Sequence

from ..config import InferenceConfig
from ..errors import NoFleet
from ..client.engine_client import EngineClient
from .fleet_client import FleetClient
from ..client.generate_call import GenerateCall, stream_request_outputs
from ..generation_config import GenerationDefaults
from ..model.hub import resolve_model
from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS
from ..wire.lifecycle import PauseMode, Verb
from ..wire.verb_calls import verb_call
from ..client.outputs import StreamItem
from ..client.chat_messages import Conversation, render_conversations
from ..client.prompts import ImagePrompt, Prompt, PromptInput, as_prompt, normalize_prompts
from ..wire.request import DynamicInferenceRequest, FinishReason
from ..wire.sampling_params import SamplingParams
from ..client.lora_request import LoRARequest, apply_lora
from ..client.request_checks import ServingBounds
from ..client.vllm_args import wake_up_plan
from ..client.vllm_outputs import RequestOutput
from ..tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    import torch

logger = logging.getLogger("megatron_serve.client")


class MegatronAsyncLLM:
    """Asyncio front end over one in-process engine or a coordinator fleet (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        inference_config: InferenceConfig | None = None,
        use_coordinator: bool = False,
        coordinator_address: str | None = None,
        num_engines: int = 1,
        tokenizer: Tokenizer | str | os.PathLike | None = None,
        token: str | None = None,
        *,
        generation_config: str | os.PathLike | None = "auto",
        max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS,
    ) -> None:
        """``model``, ``generation_config`` and ``max_request_logprobs`` as in
        :class:`~megatron_serve.api.llm.MegatronLLM`."""
        if isinstance(max_request_logprobs, bool) or not isinstance(max_request_logprobs, int) \
                or max_request_logprobs < 1:
            raise ValueError(f"max_request_logprobs must be a positive integer, got {max_request_logprobs!r}")
        self.use_coordinator = bool(use_coordinator)
        if isinstance(model, (str, os.PathLike)):
            model = resolve_model(model, tokenizer=tokenizer is None)
        self.generation_defaults = GenerationDefaults.load(
            generation_config, model if isinstance(model, Path) else None)
        self.model = model
        self._tokenizer = tokenizer
        # LoRA directories are checked here only where the engines read them: this machine (direct mode, a local
        # fleet); a remote fleet's engines may see other files.
        self._local_files = not self.use_coordinator or coordinator_address is None
        self._bounds: ServingBounds | None = None
        self._client: EngineClient
        if self.use_coordinator:
            self.engine = None
            by_path = isinstance(tokenizer, (str, os.PathLike))
            self._client = FleetClient(coordinator_address, model=model, num_engines=int(num_engines),
                                       inference_config=inference_config, token=token,
                                       max_request_logprobs=max_request_logprobs,
                                       tokenizer_dir=tokenizer if by_path else None,
                                       tokenizer=None if by_path else tokenizer)
        else:
            if inference_config is not None and inference_config.data_parallel_size > 1:
                raise ValueError(f"data_parallel_size {inference_config.data_parallel_size} is data-parallel "
                                 "attention: an engine process per rank, which a fleet starts (use_coordinator=True)")
            from ..client.local_engine import LocalEngineClient, build_engine  # noqa: PLC0415 - torch only when an engine lives here

            self.engine = build_engine(model, inference_config, tokenizer)
            self._tokenizer = self.engine.tokenizer
            self._client = LocalEngineClient(self.engine, max_request_logprobs)
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._closed = False

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (in coordinator mode the one the client makes the text with, once started;
        else loaded on first use)."""
        if self._tokenizer is None or isinstance(self._tokenizer, (str, os.PathLike)):
            self._tokenizer = getattr(self._client, "tokenizer", None) or self._tokenizer
        if self._tokenizer is None and isinstance(self.model, (str, os.PathLike)):
            self._tokenizer = Tokenizer.from_pretrained(Path(self.model))
        elif isinstance(self._tokenizer, (str, os.PathLike)):
            self._tokenizer = Tokenizer.from_pretrained(Path(self._tokenizer))
        return self._tokenizer

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """vLLM's ``get_tokenizer``: the Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.tokenizer.hf_tokenizer

    @property
    def client(self) -> EngineClient:
        """The engine client requests go through (what :meth:`serve` serves)."""
        return self._client

    # ------------------------------------------------------------------ start / stop

    async def start(self, timeout: float = 600.0) -> "MegatronAsyncLLM":
        """Start the engine thread, or connect (starting a local fleet first when no address was given)."""
        if self._closed:
            raise RuntimeError("this MegatronAsyncLLM was shut down")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:  # concurrent first calls must not start two fleets
            if not self._started:
                await self._client.start(timeout)
                self._started = True
        return self

    async def close(self) -> None:
        """Release everything this object holds, in either mode (what ``async with`` calls on exit)."""
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    async def __aenter__(self) -> "MegatronAsyncLLM":
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: PromptInput,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 request_id: str | None = None, *, lora_request: Any = None) -> GenerateCall:
        """Awaited: one finished request for a single prompt, a list (input order) for a batch.
        Iterated (``async for``): vLLM's ``AsyncLLM.generate``, one prompt's ``RequestOutput`` as it grows.

        A prompt is text, token ids, vLLM's ``{"prompt_token_ids": [...]}`` or ``{"prompt": text}``, or
        ``{"prompt": ..., "images": [bytes or PIL.Image, ...]}`` (see :meth:`MegatronLLM.generate`).
        ``sampling_params``: one for every prompt, or a list of one per prompt (as vLLM's ``LLM.generate``).
        Awaited with ``n`` > 1, each prompt gives ``n`` requests, prompt by prompt (``[p0 c0, p0 c1, p1 c0,
        ...]``: a list even for a single prompt); iterated, one ``RequestOutput`` holds the ``n`` outputs
        (request ids ``{index}_{request_id}``, as vLLM's). ``request_id``: iterated only (default: a new
        one). ``lora_request``: a :class:`~megatron_serve.LoRARequest`, or a list of one per prompt.
        """
        prompt_list, single = normalize_prompts(prompts)
        jobs = apply_lora(self.plan_jobs(prompt_list, sampling_params), lora_request, len(prompt_list))

        async def result() -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
            if request_id is not None:
                raise ValueError("request_id names the request of an iterated generate (async for); awaited, "
                                 "each request gets an id of its own")
            results = await self.run_jobs(jobs)
            return results[0] if single and len(results) == 1 else results

        async def stream() -> AsyncIterator[RequestOutput]:
            if not single:
                raise ValueError("an iterated generate (async for) runs one prompt, as vLLM's AsyncLLM.generate: "
                                 "await generate(...) runs a batch")
            await self.start()
            await self.check_jobs(jobs)
            choices = [params for _, _, params in jobs]
            async for output in stream_request_outputs(self._client, self.tokenizer, jobs[0][1], choices,
                                                       request_id or uuid.uuid4().hex):
                yield output

        return GenerateCall(result, stream)

    async def chat(self, messages: Conversation | Sequence[Conversation],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                   tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None
                   ) -> list[DynamicInferenceRequest]:
        """vLLM's ``LLM.chat``: conversations rendered with the model's chat template, then generated.

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them;
        ``tools`` (OpenAI function definitions), ``add_generation_prompt``, ``continue_final_message``
        and ``chat_template_kwargs`` (template variables, e.g. ``{"enable_thinking": False}``) reach the
        template. Always a list, one request per conversation (``n`` per conversation with ``n`` > 1),
        each with the rendered text as its ``prompt``. Tool calls are not parsed out of the text.
        The template writes the special tokens (BOS): the text is tokenized without adding them.
        """
        texts, jobs = self.chat_jobs(messages, sampling_params, tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     chat_template_kwargs=chat_template_kwargs)
        results = await self.run_jobs(jobs)
        for (index, _, _), result in zip(jobs, results):
            result.prompt = texts[index]
        return results

    def chat_jobs(self, messages: Conversation | Sequence[Conversation],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None, *,
                  tools: list[dict[str, Any]] | None, add_generation_prompt: bool, continue_final_message: bool,
                  chat_template_kwargs: dict[str, Any] | None
                  ) -> tuple[list[str], list[tuple[int, Prompt, SamplingParams]]]:
        """The rendered conversations and the requests that generate them (see :meth:`chat`)."""
        texts = render_conversations(self.tokenizer, messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     template_kwargs=chat_template_kwargs)
        prompts: list[Prompt] = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return texts, self.plan_jobs(prompts, sampling_params)

    async def run_jobs(self, jobs: list[tuple[int, Prompt, SamplingParams]],
                       on_finished: Callable[[int], None] | None = None) -> list[DynamicInferenceRequest]:
        """Every job's finished request, in job order; ``on_finished(job index)`` is called as each one
        finishes (the progress bar of :meth:`MegatronLLM.generate`)."""
        await self.check_jobs(jobs)
        futures = [self._client.add_request(prompt, params) for _, prompt, params in jobs]
        if on_finished is not None:
            for index, future in enumerate(futures):
                future.add_done_callback(lambda _, index=index: on_finished(index))
        results = list(await asyncio.gather(*futures))
        for result in results:
            if result.finish_reason == FinishReason.ERROR:  # what no check here foresaw (e.g. a KV pool too small)
                logger.warning("request %s failed: %s", result.request_id, result.error)
        return results

    async def check_jobs(self, jobs: list[tuple[int, Prompt, SamplingParams]]) -> None:
        """Start, then raise ``ValueError`` for the first job the engines would refuse (vLLM's checks and words:
        :mod:`megatron_serve.client.request_checks`), before any job is sent."""
        await self.start()
        bounds = self._bounds
        if bounds is None:
            status = await self._client.status()
            bounds = ServingBounds.from_status(status, self._vocab_size(), local_lora_paths=self._local_files)
            if status.get("engines"):  # known for good once the engines have said it
                self._bounds = bounds
        tokenizer = self.tokenizer
        for index, prompt, params in jobs:
            bounds.check(index, prompt, params, tokenizer)

    def _vocab_size(self) -> int | None:
        """The model's vocabulary: the engine's here, else the model directory's ``config.json`` (when known)."""
        if self.engine is not None:
            return int(self.engine.model.config.vocab_size)
        if isinstance(self.model, Path) and (self.model / "config.json").is_file():
            from ..model.config import ModelConfig  # noqa: PLC0415

            return ModelConfig.from_dir(self.model).vocab_size
        return None

    def plan_jobs(self, prompts: list[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None
                  ) -> list[tuple[int, Prompt, SamplingParams]]:
        """``(prompt index, prompt, parameters)`` of every request: one set of parameters per prompt, ``n``
        requests per prompt, each prompt cut to its ``truncate_prompt_tokens`` last tokens."""
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params holds {len(sampling_params)} SamplingParams for {len(prompts)} "
                                 "prompts: give one, or one per prompt")
            per_prompt = list(sampling_params)
        else:
            default = sampling_params if sampling_params is not None else self.generation_defaults.sampling_params()
            per_prompt = [default] * len(prompts)
        jobs = []
        for index, (prompt, params) in enumerate(zip(prompts, per_prompt)):
            params.validate()
            prompt = self._truncated(prompt, params.truncate_prompt_tokens)
            jobs.extend((index, prompt, choice) for choice in params.choices())
        return jobs

    def _truncated(self, prompt: Prompt, keep: int | None) -> Prompt:
        """``prompt``'s last ``keep`` tokens (text is tokenized here, with the tokenizer's special tokens)."""
        if keep is None:
            return prompt
        if isinstance(prompt, ImagePrompt):
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images (it would cut their "
                             "placeholders): shorten the prompt instead")
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return tokens[-keep:]

    async def generate_stream(self, prompt: Prompt | dict, sampling_params: SamplingParams | None = None
                              ) -> AsyncIterator[StreamItem]:
        """Yield :class:`~megatron_serve.client.outputs.StreamPartial` items as tokens are generated, then the
        finished request. ``prompt``: one prompt of any shape :meth:`generate` takes; one sequence (``n`` 1)."""
        jobs = self.plan_jobs([as_prompt(prompt)], sampling_params)
        if len(jobs) != 1:
            raise ValueError("generate_stream runs one sequence: n must be 1 (generate takes n)")
        ((_, one, params),) = jobs
        await self.check_jobs(jobs)
        async for item in self._client.add_request_streaming(one, params):
            yield item

    # ------------------------------------------------------------------ lifecycle (coordinator mode)

    async def control(self, verb: Verb | str, **arguments: Any) -> dict[str, Any]:
        """Run a lifecycle verb (a :class:`~megatron_serve.wire.lifecycle.Verb` or its name) with the arguments the
        verb table (:mod:`megatron_serve.wire.verb_calls`) gives it, and an optional ``timeout``; resolves on the
        fleet's acknowledgement. The named methods (:meth:`pause`, :meth:`refit`, ...) are this call. Arguments are
        checked first, in either mode; in direct mode only refit and the LoRA verbs run (others raise ``NoFleet``)."""
        timeout = arguments.pop("timeout", None)
        verb_call(verb).bind(arguments)  # a bad argument is refused in either mode of this object
        await self.start()
        return await self._client.control(verb, timeout, **arguments)

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP, *, drain_timeout: float | None = None
                    ) -> dict[str, Any]:
        """Stop stepping at a step boundary, keep memory; resolves on the fleet's acknowledgement.

        ``mode``: ``"keep"`` (default: requests pause in place), ``"wait"`` (running requests finish
        first, for at most ``drain_timeout`` seconds), ``"abort"`` (unfinished requests end at once
        with ``finish_reason`` ``"abort"`` and their tokens so far); see :meth:`InferenceClient.pause`.
        """
        return await self.control(Verb.PAUSE, mode=mode, drain_timeout=drain_timeout)

    async def unpause(self) -> dict[str, Any]:
        return await self.control(Verb.UNPAUSE)

    async def suspend(self, level: int = 1, keep_kv: bool = False) -> dict[str, Any]:
        """Release the KV cache (level 2: also weights); pauses first when running. ``keep_kv``: the requests in
        flight keep their KV in host memory and continue after ``resume`` without recomputing it."""
        return await self.control(Verb.SUSPEND, level=level, keep_kv=keep_kv)

    async def resume(self) -> dict[str, Any]:
        return await self.control(Verb.RESUME)

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """vLLM's ``sleep``: the fleet's ``suspend(level)`` (level 1 releases the KV cache, level 2 also moves
        the weights to host memory); coordinator mode only."""
        if self.engine is not None:  # named as the caller called it: suspend() is not what they wrote
            raise NoFleet("sleep() needs coordinator mode (use_coordinator=True): this engine runs in this process, "
                          "with no fleet to put to sleep")
        return await self.suspend(level)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """vLLM's ``wake_up``: ``resume``, then ``unpause`` unless ``tags`` is ``["weights"]``.

        The fleet restores the weights and the KV cache together: ``["weights"]`` restores both but leaves
        the fleet paused, so that a ``refit`` can load new weights before anything runs; ``["kv_cache"]``
        or no tags then let it run. Other tags are refused by name.
        """
        if self.engine is not None:  # named as the caller called it: resume() is not what they wrote
            raise NoFleet("wake_up() needs coordinator mode (use_coordinator=True): this engine runs in this "
                          "process, with no fleet to wake up")
        unpause = wake_up_plan(tags)
        ack = await self.resume()
        return await self.unpause() if unpause else ack

    async def stop(self) -> dict[str, Any]:
        """The STOP verb for the whole fleet (also one this object did not start)."""
        return await self.control(Verb.STOP)

    async def refit(self, weights: "str | os.PathLike | Iterable[tuple[str, torch.Tensor]]",
                    epoch: int | None = None) -> dict[str, Any]:
        """Load new weights in place: a model directory of the served model's shapes, or ``(name,
        tensor)`` pairs with Hugging Face checkpoint names and full (unsharded) shapes, any subset.

        Coordinator mode: the REFIT verb (the fleet must be PAUSED or SUSPENDED); tensors travel
        from this process over a collective (:class:`~megatron_serve.WeightSender`).
        Direct mode: the engine refits between two steps (tensors are copied in, every
        tensor-parallel rank taking its slice). Either way the answer is ``{"state", "detail":
        {"epoch", "source", "engines": {id: timings}}}``, and names or shapes that do not fit raise
        (``ControlError`` / ``ValueError``) with the old weights still serving.
        """
        if isinstance(weights, (str, os.PathLike)):
            return await self.control(Verb.REFIT, source=os.fspath(weights), epoch=epoch)
        await self.start()
        return await self._client.refit_tensors(weights, epoch)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's ``add_lora``: every engine serves ``lora_request``'s adapter under its name from now on (LOAD_LORA
        in coordinator mode: verified on every engine first). True once served; a bad adapter or a name already
        served raises ``ControlError`` (``lora_refused``) with nothing changed."""
        if not isinstance(lora_request, LoRARequest) or not lora_request.lora_path:
            raise ValueError(f"add_lora needs a LoRARequest with a lora_path, got {lora_request!r}")
        await self.control(Verb.LOAD_LORA, lora_name=lora_request.lora_name, lora_path=lora_request.lora_path)
        return True

    async def remove_lora(self, lora_name: str) -> bool:
        """vLLM's ``remove_lora``, by name (adapters are told apart by name here): no engine serves it to new
        requests; running ones finish under it. ``ControlError`` (``lora_not_found``) when none serves it."""
        await self.control(Verb.UNLOAD_LORA, lora_name=lora_name)
        return True

    async def list_loras(self) -> set[str]:
        """vLLM's ``list_loras``: the names of the adapters the engines serve."""
        return {name for engine in (await self.status())["engines"] for name in (engine.get("loras") or {})}

    async def status(self) -> dict[str, Any]:
        """The ``STATUS_REPLY`` fields (in direct mode, one engine's from its own counters)."""
        await self.start()
        return await self._client.status()

    async def shutdown(self) -> None:
        """Stop the local fleet this object started (STOP, then the processes), or disconnect from a remote one."""
        await self._client.shutdown()
        await self.close()

    async def serve(self, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
        """Serve the OpenAI-compatible HTTP API for this object until cancelled (either mode).

        ``options``: ``model_name``, ``api_key``, ``admin_key`` (opens ``/v1/admin/*``, the lifecycle over
        HTTP), ``max_concurrent_requests``, ``log_level``, ``stop`` (an ``asyncio.Event``), ``limits``,
        ``read_timeout``, ``timeout_keep_alive``, ``max_connections``, ``drain_timeout``, ``image_options``
        (a ``multimodal.ImageOptions``), ``options`` (an ``http_options.HTTPOptions``: tool-call parser, CORS,
        request and stats logs, ``vllm:`` metrics), ``stream_interval``, ``tenancy``; see
        :func:`megatron_serve.server.serve_async_llm`.
        """
        from ..server.local import serve_async_llm  # noqa: PLC0415 - FastAPI only when serving

        await serve_async_llm(self, host, port, **options)
