"""``MegatronLLM``: the blocking Python API (docs/python-api.md; vLLM's ``LLM``: docs/vllm-mapping.md).

A :class:`~megatron_serve.client.async_llm.MegatronAsyncLLM` on a background event-loop thread
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
from typing import Any, Coroutine, Sequence, TypeVar

from .async_llm import MegatronAsyncLLM
from .chat_messages import Conversation
from ..config import InferenceConfig
from ..generation_config import GenerationDefaults
from ..wire.lifecycle import PauseMode
from .loop_thread import EventLoopThread
from ..model.llama import LlamaForCausalLM
from .prompts import PromptInput, normalize_prompts
from ..wire.request import DynamicInferenceRequest
from ..wire.sampling_params import SamplingParams
from ..tokenizer import Tokenizer

T = TypeVar("T")


class MegatronLLM:
    """``model``: a model directory, a Hub id (``org/name[@revision]``, see :mod:`megatron_serve.hub`) or a
    built model (with ``tokenizer=``). ``generation_config``: ``"auto"`` applies the model's
    ``generation_config.json`` sampling defaults when ``generate`` gets no ``SamplingParams`` (as vLLM's
    ``LLM`` does), ``"none"`` ignores them, a directory reads its file (:mod:`megatron_serve.generation_config`).
    """

    def __init__(self, model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None = None,
                 use_coordinator: bool = False, coordinator_address: str | None = None, num_engines: int = 1,
                 tokenizer: Tokenizer | str | Path | None = None, token: str | None = None, *,
                 generation_config: str | os.PathLike | None = "auto"):
        self.use_coordinator = use_coordinator
        llm = MegatronAsyncLLM(model, inference_config, use_coordinator, coordinator_address, num_engines, tokenizer,
                               token, generation_config=generation_config)
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
    def tokenizer(self) -> Any:
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

    def generate(self, prompts: PromptInput, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[DynamicInferenceRequest]:
        """Generate for every prompt; returns one finished request per prompt, in input order.

        A prompt is text, token ids, or ``{"prompt": ..., "images": [bytes or PIL.Image, ...]}`` with one
        image placeholder of the model (e.g. ``<image>``) in the prompt where each image goes.
        ``sampling_params``: one for all prompts, or a list of one per prompt (as vLLM's ``LLM.generate``);
        with ``n`` > 1, ``n`` requests per prompt, prompt by prompt.
        """
        prompt_list, _ = normalize_prompts(prompts)  # bad prompts raise here, in the caller's thread
        result = self._run(self._async().generate(prompt_list, sampling_params))
        return result if isinstance(result, list) else [result]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None
             ) -> list[DynamicInferenceRequest]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them,
        rendered with the model's chat template and generated; see :meth:`MegatronAsyncLLM.chat`."""
        return self._run(self._async().chat(messages, sampling_params, tools=tools,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template_kwargs=chat_template_kwargs))

    def pause(self, mode: PauseMode | str = PauseMode.KEEP, *, drain_timeout: float | None = None) -> dict:
        """Stop stepping at a step boundary, keeping memory; returns the acknowledgement.

        ``mode`` ``"keep"`` (default), ``"wait"`` or ``"abort"``: see :meth:`MegatronAsyncLLM.pause`.
        """
        return self._run(self._async().pause(mode, drain_timeout=drain_timeout))

    def unpause(self) -> dict:
        return self._run(self._async().unpause())

    def suspend(self, level: int = 1) -> dict:
        """Release the KV cache (level 2: also weights to host); pauses first when running."""
        return self._run(self._async().suspend(level))

    def resume(self) -> dict:
        return self._run(self._async().resume())

    def status(self) -> dict:
        return self._run(self._async().status())

    def refit(self, weights: "str | os.PathLike | Iterable[tuple[str, torch.Tensor]]",
              epoch: int | None = None) -> dict:
        """Load new weights in place: a model directory of the same shapes, or ``(name, tensor)`` pairs
        with Hugging Face names and full shapes (any subset, e.g. a trainer's ``named_parameters()``).

        Coordinator mode: the REFIT verb (PAUSE first; tensors travel with a
        :class:`~megatron_serve.weights.WeightSender`). Direct mode: the engine loads them between
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


def _release(llm: MegatronAsyncLLM, loop_thread: EventLoopThread) -> None:
    """Close ``llm`` on its loop, then stop the loop (``close()``, or the collector's finalizer)."""
    if loop_thread.in_loop_thread:  # dropped by a callback on its own loop: nothing here can wait for it
        loop_thread.loop.call_soon(loop_thread.loop.stop)
        return
    try:
        loop_thread.run(llm.close())
    finally:
        loop_thread.stop()
