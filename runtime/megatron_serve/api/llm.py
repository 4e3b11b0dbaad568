"""``MegatronLLM``, the blocking Python API, and ``LLM``, the same as vLLM's (docs/python-api.md).

A :class:`~megatron_serve.api.async_llm.MegatronAsyncLLM` on a background event-loop thread
(:class:`~megatron_serve.client.loop_thread.EventLoopThread`); every call blocks on it. Direct mode
(``use_coordinator=False``) runs one engine in this process, coordinator mode talks to a fleet:
which one is the engine client's business (:mod:`megatron_serve.client.engine_client`), not this class's.

Nothing it starts keeps it alive: an object that is dropped without ``close()`` is closed when it
is collected (its threads stop and its engine, with its KV pool, is freed), as an engine built in
the caller's thread would be.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence, TypeVar

import msgspec

from .async_llm import MegatronAsyncLLM
from ..client.chat_messages import Conversation
from ..config import InferenceConfig
from ..errors import NoFleet
from ..generation_config import GenerationDefaults
from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS
from ..wire.lifecycle import PauseMode, Verb
from ..client.loop_thread import EventLoopThread
from ..model.llama import LlamaForCausalLM
from ..client.progress import progress_bar
from ..client.prompts import Prompt, PromptInput, normalize_prompts
from ..client.lora_request import LoRARequest, apply_lora
from ..client.vllm_args import log_warnings, model_directory, parse_llm_keywords
from ..client.vllm_outputs import RequestOutput, Shaper
from ..wire.request import DynamicInferenceRequest
from ..wire.sampling_params import SamplingParams
from ..tokenizer import Tokenizer

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


class MegatronLLM:
    """``model``: a model directory, a Hub id (``org/name[@revision]``, see :mod:`megatron_serve.model.hub`) or a
    built model (with ``tokenizer=``). ``generation_config``: ``"auto"`` applies the model's
    ``generation_config.json`` sampling defaults when ``generate`` gets no ``SamplingParams`` (as vLLM's
    ``LLM`` does), ``"none"`` ignores them, a directory reads its file (:mod:`megatron_serve.generation_config`).
    ``max_request_logprobs``: the log-prob entries one request (one choice) may ask for, prompt positions x
    (``prompt_logprobs`` + 1) + tokens to generate x (``logprobs`` + 1), as ``megatron-serve run``'s
    ``--max-request-logprobs`` bounds them (it is given to the coordinator a fleet started here runs); more is a
    ``ValueError`` naming the budget and the request's figure, before any of it is computed.
    """

    def __init__(self, model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None = None,
                 use_coordinator: bool = False, coordinator_address: str | None = None, num_engines: int = 1,
                 tokenizer: Tokenizer | str | Path | None = None, token: str | None = None, *,
                 generation_config: str | os.PathLike | None = "auto",
                 max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS):
        self.use_coordinator = use_coordinator
        llm = MegatronAsyncLLM(model, inference_config, use_coordinator, coordinator_address, num_engines, tokenizer,
                               token, generation_config=generation_config, max_request_logprobs=max_request_logprobs)
        self.engine = llm.engine  # direct mode: the engine in this process (None in coordinator mode)
        self._llm: MegatronAsyncLLM | None = llm
        self._loop_thread = EventLoopThread("megatron-llm-loop")
        self._release = weakref.finalize(self, _release, llm, self._loop_thread)
        self._release.atexit = False  # at exit, the threads (daemons) end with the process
        try:  # a fleet that cannot be reached fails the constructor, not a later call
            self._loop_thread.run(llm.start())
        except BaseException:
            self.close()
            raise

    @property
    def tokenizer(self) -> Tokenizer | None:
        if self._llm is None:
            raise RuntimeError("this MegatronLLM was shut down")
        return self._llm.tokenizer

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling defaults ``generate`` applies when it gets no ``SamplingParams``."""
        return self._async().generation_defaults

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        if self._llm is None:
            call.close()
            raise RuntimeError("this MegatronLLM was shut down")
        return self._loop_thread.run(call)

    def _async(self) -> MegatronAsyncLLM:
        if self._llm is None:
            raise RuntimeError("this MegatronLLM was shut down")
        return self._llm

    def generate(self, prompts: PromptInput, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = False, lora_request: Any = None
                 ) -> list[DynamicInferenceRequest]:
        """Generate for every prompt; returns one finished request per prompt, in input order.

        A prompt is text, token ids, vLLM's ``{"prompt_token_ids": [...]}``, or ``{"prompt": ..., "images":
        [bytes or PIL.Image, ...]}`` with one image placeholder of the model (e.g. ``<image>``) in the prompt
        where each image goes. ``sampling_params``: one for all prompts, or a list of one per prompt (as
        vLLM's ``LLM.generate``); with ``n`` > 1, ``n`` requests per prompt, prompt by prompt (:class:`LLM`
        groups them as vLLM does). ``use_tqdm``: a progress bar (``True``, or a ``tqdm``-like class).
        ``lora_request``: a :class:`~megatron_serve.LoRARequest` for every prompt, or a list of one per prompt
        (the engines need ``enable_lora``).
        """
        prompt_list, _ = normalize_prompts(prompts)  # bad prompts raise here, in the caller's thread
        jobs = apply_lora(self._async().plan_jobs(prompt_list, sampling_params), lora_request, len(prompt_list))
        return self._run_jobs(jobs, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = False, lora_request: Any = None, *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None
             ) -> list[DynamicInferenceRequest]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them,
        rendered with the model's chat template and generated; see :meth:`MegatronAsyncLLM.chat`."""
        *_, results = self._chat(messages, sampling_params, use_tqdm, lora_request, tools=tools,
                                 add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message,
                                 chat_template_kwargs=chat_template_kwargs)
        return results

    def _chat(self, messages: Conversation | Sequence[Conversation],
              sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool | Callable[..., Any],
              lora_request: Any, **template: Any
              ) -> tuple[list[str], list[tuple[int, Prompt, SamplingParams]], list[DynamicInferenceRequest]]:
        """The rendered conversations, the requests and their results (each with its conversation's text as
        its ``prompt``)."""
        texts, jobs = self._async().chat_jobs(messages, sampling_params, **template)
        jobs = apply_lora(jobs, lora_request, len(texts))
        results = self._run_jobs(jobs, use_tqdm)
        for (index, _, _), result in zip(jobs, results):
            result.prompt = texts[index]
        return texts, jobs, results

    def _run_jobs(self, jobs: list[tuple[int, Prompt, SamplingParams]], use_tqdm: bool | Callable[..., Any]
                  ) -> list[DynamicInferenceRequest]:
        """Run the requests, with vLLM's "Processed prompts" bar when asked (a prompt counts once all its
        ``n`` requests finished)."""
        if not use_tqdm:
            return self._run(self._async().run_jobs(jobs))
        bar = progress_bar(use_tqdm, jobs)
        try:
            return self._run(self._async().run_jobs(jobs, bar.finished))
        finally:
            bar.close()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """vLLM's ``get_tokenizer``: the Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self._async().get_tokenizer()

    def sleep(self, level: int = 1) -> dict:
        """vLLM's ``sleep``: :meth:`suspend` (level 1 releases the KV cache, level 2 also moves the weights to
        host memory). Needs a fleet (coordinator mode; :class:`LLM`: ``enable_sleep_mode=True``)."""
        return self._run(self._async().sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """vLLM's ``wake_up``: :meth:`resume`, then :meth:`unpause` unless ``tags`` is ``["weights"]`` (which
        leaves the fleet paused for a :meth:`refit`); see :meth:`MegatronAsyncLLM.wake_up`."""
        return self._run(self._async().wake_up(tags))

    def control(self, verb: Verb | str, **arguments: Any) -> dict:
        """Run a lifecycle verb with its arguments, blocking until the fleet acknowledged it
        (:meth:`MegatronAsyncLLM.control`: the verb table's arguments and an optional ``timeout``)."""
        return self._run(self._async().control(verb, **arguments))

    def pause(self, mode: PauseMode | str = PauseMode.KEEP, *, drain_timeout: float | None = None) -> dict:
        """Stop stepping at a step boundary, keeping memory; returns the acknowledgement.

        ``mode`` ``"keep"`` (default), ``"wait"`` or ``"abort"``: see :meth:`MegatronAsyncLLM.pause`.
        """
        return self._run(self._async().pause(mode, drain_timeout=drain_timeout))

    def unpause(self) -> dict:
        return self._run(self._async().unpause())

    def suspend(self, level: int = 1, keep_kv: bool = False) -> dict:
        """Release the KV cache (level 2: also weights to host); pauses first when running. ``keep_kv``: the
        requests in flight keep their KV in host memory and continue after ``resume`` without recomputing it."""
        return self._run(self._async().suspend(level, keep_kv=keep_kv))

    def resume(self) -> dict:
        return self._run(self._async().resume())

    def status(self) -> dict:
        return self._run(self._async().status())

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's ``add_lora`` (:meth:`MegatronAsyncLLM.add_lora`): serve the adapter by name from now on."""
        return self._run(self._async().add_lora(lora_request))

    def remove_lora(self, lora_name: str) -> bool:
        """vLLM's ``remove_lora``, by name: new requests no longer get it; running ones finish under it."""
        return self._run(self._async().remove_lora(lora_name))

    def list_loras(self) -> set[str]:
        """vLLM's ``list_loras``: the names of the adapters served."""
        return self._run(self._async().list_loras())

    def refit(self, weights: "str | os.PathLike | Iterable[tuple[str, torch.Tensor]]",
              epoch: int | None = None) -> dict:
        """Load new weights in place: a model directory of the same shapes, or ``(name, tensor)`` pairs
        with Hugging Face names and full shapes (any subset, e.g. a trainer's ``named_parameters()``).

        Coordinator mode: the REFIT verb (PAUSE first; tensors travel with a
        :class:`~megatron_serve.WeightSender`). Direct mode: the engine loads them between
        two steps. Names and shapes that do not fit raise with the old weights still serving. See
        :meth:`MegatronAsyncLLM.refit`.
        """
        return self._run(self._async().refit(weights, epoch))

    def shutdown(self) -> None:
        """Stop the local fleet this object started, or disconnect from a remote one (coordinator mode only)."""
        self._run(self._async().shutdown())
        self.close()

    def close(self) -> None:
        """Release everything this object holds, in either mode (what ``with`` calls on exit).

        Direct mode: stops the engine thread and the engine's tensor-parallel followers, if any.
        """
        self._llm = self.engine = None
        self._release()

    def __enter__(self) -> "MegatronLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class LLM(MegatronLLM):
    """vLLM's ``LLM``: its constructor keywords, and results shaped as its ``RequestOutput``.

    ``LLM(model, tensor_parallel_size=..., max_model_len=..., gpu_memory_utilization=..., ...)``: every
    keyword is vLLM's; :mod:`megatron_serve.client.vllm_args` says what each sets, which are accepted
    with a warning and which refused (docs/python-api.md has the table). The engine runs in this process,
    unless ``data_parallel_size`` > 1 or ``enable_sleep_mode=True`` start a local fleet (``sleep`` and
    ``wake_up`` need one). ``generate`` and ``chat`` return one
    :class:`~megatron_serve.client.vllm_outputs.RequestOutput` per prompt, its ``n`` choices in
    ``outputs``, each keeping its Megatron record (``outputs[i].request``); ``use_tqdm`` defaults to a
    progress bar, as vLLM's. Everything :class:`MegatronLLM` has (``refit``, ``pause``, ...) is here too.
    """

    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        parsed = parse_llm_keywords(kwargs)
        log_warnings(parsed)
        super().__init__(model_directory(model, parsed.options), InferenceConfig(**parsed.config),
                         use_coordinator=parsed.use_coordinator, num_engines=parsed.num_engines,
                         tokenizer=parsed.options.get("tokenizer"),
                         generation_config=parsed.options.get("generation_config", "auto"))

    def generate(self, prompts: PromptInput, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:  # type: ignore[override]
        """vLLM's ``LLM.generate``: one ``RequestOutput`` per prompt, in input order, with ``n`` outputs each.

        ``priority``: one per prompt (lower runs first), as vLLM's.
        """
        prompt_list, _ = normalize_prompts(prompts)
        if sampling_params is None and priority is not None:
            sampling_params = self.generation_defaults.sampling_params()
        per_prompt = _with_priority(sampling_params, priority, len(prompt_list))
        jobs = apply_lora(self._async().plan_jobs(prompt_list, per_prompt), lora_request, len(prompt_list))
        records = self._run_jobs(jobs, use_tqdm)
        return Shaper(self.tokenizer).group_by_prompt([index for index, _, _ in jobs], records)

    def chat(self, messages: Conversation | Sequence[Conversation],  # type: ignore[override]
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None, *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None
             ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one ``RequestOutput`` per conversation, its ``prompt`` the rendered text."""
        texts, jobs, records = self._chat(messages, sampling_params, use_tqdm, lora_request, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          chat_template_kwargs=chat_template_kwargs)
        return Shaper(self.tokenizer).group_by_prompt([index for index, _, _ in jobs], records, texts)

    def sleep(self, level: int = 1) -> dict:
        """vLLM's ``sleep`` (see :meth:`MegatronLLM.sleep`); needs ``LLM(..., enable_sleep_mode=True)``."""
        if self.engine is not None:
            raise NoFleet("sleep() needs a fleet to suspend: build the LLM with enable_sleep_mode=True (or "
                          "data_parallel_size > 1); this one runs its engine in this process")
        return super().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """vLLM's ``wake_up`` (see :meth:`MegatronLLM.wake_up`); needs ``LLM(..., enable_sleep_mode=True)``."""
        if self.engine is not None:
            raise NoFleet("wake_up() needs a fleet to wake: build the LLM with enable_sleep_mode=True (or "
                          "data_parallel_size > 1); this one runs its engine in this process")
        return super().wake_up(tags)


def _with_priority(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                   priority: Sequence[int] | None, count: int) -> SamplingParams | Sequence[SamplingParams] | None:
    """vLLM's per-prompt ``priority`` list folded into one ``SamplingParams`` per prompt."""
    if priority is None:
        return sampling_params
    if len(priority) != count:
        raise ValueError(f"priority holds {len(priority)} values for {count} prompts: give one per prompt")
    base = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * count
    return [msgspec.structs.replace(params, priority=value) for params, value in zip(base, priority)]


def _release(llm: MegatronAsyncLLM, loop_thread: EventLoopThread) -> None:
    """Close ``llm`` on its loop, then stop the loop (``close()``, or the collector's finalizer)."""
    if loop_thread.in_loop_thread:  # dropped by a callback on its own loop: nothing here can wait for it
        loop_thread.loop.call_soon(loop_thread.loop.stop)
        return
    try:
        loop_thread.run(llm.close())
    finally:
        loop_thread.stop()
