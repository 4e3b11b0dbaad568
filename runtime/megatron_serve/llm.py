"""``MegatronLLM``: the blocking Python API (DESIGN section 4).

Direct mode (``use_coordinator=False``) runs one engine in this process and steps it until the
batch is done. Coordinator mode talks to a fleet through the coordinator protocol.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from .config import InferenceConfig
from .engine import DynamicInferenceEngine
from .model.llama import LlamaForCausalLM
from .prompts import Prompt, PromptInput, normalize_prompts, tokenize_prompt
from .request import DynamicInferenceRequest
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


def build_engine(model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None,
                 tokenizer: Tokenizer | str | Path | None) -> DynamicInferenceEngine:
    """An engine from a model directory, or from an already built model plus its tokenizer."""
    config = inference_config or InferenceConfig()
    if isinstance(model, (str, Path)):
        return DynamicInferenceEngine.from_model_dir(model, config)
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a model directory or a LlamaForCausalLM, got {type(model).__name__}")
    if tokenizer is None:
        raise ValueError("a model object needs tokenizer= (a Tokenizer or a directory holding tokenizer files)")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_pretrained(tokenizer)
    return DynamicInferenceEngine(model, tokenizer, config)


def make_requests(prompts: list[Prompt], sampling_params: SamplingParams, tokenizer: Tokenizer,
                  ids: "itertools.count[int]") -> list[DynamicInferenceRequest]:
    requests = []
    for prompt in prompts:
        tokens, images, text = tokenize_prompt(prompt, tokenizer)
        requests.append(DynamicInferenceRequest(
            request_id=str(next(ids)), prompt=text, prompt_tokens=tokens, sampling_params=sampling_params,
            images=images,
        ))
    return requests


class MegatronLLM:
    def __init__(self, model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None = None,
                 use_coordinator: bool = False, coordinator_address: str | None = None, num_engines: int = 1,
                 tokenizer: Tokenizer | str | Path | None = None, token: str | None = None):
        self.use_coordinator = use_coordinator
        self._ids = itertools.count()
        self._remote = None
        if use_coordinator:
            self._start_coordinator_mode(model, inference_config, coordinator_address, num_engines, tokenizer, token)
            return
        self.engine = build_engine(model, inference_config, tokenizer)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptInput, sampling_params: SamplingParams | None = None
                 ) -> list[DynamicInferenceRequest]:
        """Generate for every prompt; returns one finished request per prompt, in input order.

        A prompt is text, token ids, or ``{"prompt": ..., "images": [bytes or PIL.Image, ...]}`` with one
        image placeholder of the model (e.g. ``<image>``) in the prompt where each image goes.
        """
        if self.use_coordinator:
            if self._remote is None:
                raise RuntimeError("this MegatronLLM was shut down")
            result = self._loop_thread.run(self._remote.generate(prompts, sampling_params))
            return result if isinstance(result, list) else [result]
        prompt_list, _ = normalize_prompts(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params.validate()
        requests = make_requests(prompt_list, params, self.tokenizer, self._ids)
        for request in requests:
            self.engine.add_request(request)
        pending = {r.request_id for r in requests}
        while pending:
            for output in self.engine.step():
                if output.finished:
                    pending.discard(output.request.request_id)
        return requests

    def _require_coordinator(self, verb: str) -> None:
        if not self.use_coordinator:
            raise RuntimeError(f"{verb}() needs coordinator mode (MegatronLLM(..., use_coordinator=True))")

    # Coordinator mode: a MegatronAsyncLLM on a background event-loop thread; calls block on it.
    def _start_coordinator_mode(self, model, inference_config, coordinator_address, num_engines, tokenizer,
                                token) -> None:
        from .async_llm import MegatronAsyncLLM  # noqa: PLC0415
        from .loop_thread import EventLoopThread  # noqa: PLC0415

        self._loop_thread = EventLoopThread("megatron-llm-loop")
        try:
            self._remote = MegatronAsyncLLM(model, inference_config, True, coordinator_address, num_engines,
                                            tokenizer, token)
            self._loop_thread.run(self._remote.start())
        except BaseException:
            if self._remote is not None:
                self._loop_thread.run(self._remote.close())
            self._loop_thread.stop()
            raise
        self.engine = None
        self.tokenizer = tokenizer

    def _lifecycle(self, verb: str, *args):
        self._require_coordinator(verb)
        if self._remote is None:
            raise RuntimeError("this MegatronLLM was shut down")
        return self._loop_thread.run(getattr(self._remote, verb)(*args))

    def pause(self) -> dict:
        """Stop stepping at a step boundary, keeping memory; returns the acknowledgement."""
        return self._lifecycle("pause")

    def unpause(self) -> dict:
        return self._lifecycle("unpause")

    def suspend(self, level: int = 1) -> dict:
        """Release the KV cache (level 2: also weights to host); pauses first when running."""
        return self._lifecycle("suspend", level)

    def resume(self) -> dict:
        return self._lifecycle("resume")

    def status(self) -> dict:
        return self._lifecycle("status")

    def refit(self, source: str | os.PathLike, epoch: int | None = None) -> dict:
        """Load new weights of the same shapes from model directory ``source`` in place.

        Coordinator mode: the REFIT verb (PAUSE first). Direct mode: the engine loads them at once
        (``generate`` is not running: this object is single-threaded). A source of other shapes
        raises with the old weights still serving. See :meth:`MegatronAsyncLLM.refit`.
        """
        if self.use_coordinator:
            return self._lifecycle("refit", source, epoch)
        if self.engine is None:
            raise RuntimeError("this MegatronLLM was closed")
        from .async_llm import direct_refit_answer  # noqa: PLC0415

        source = os.fspath(source)
        return direct_refit_answer(source, self.engine.refit(source, epoch))

    def shutdown(self) -> None:
        """Stop the local fleet this object started, or disconnect from a remote one (coordinator mode only)."""
        self._require_coordinator("shutdown")
        self.close()

    def close(self) -> None:
        """Release everything this object holds, in either mode (what ``with`` calls on exit).

        Direct mode: stops the engine's tensor-parallel followers, if any.
        """
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
        if self._remote is None:
            return
        remote, self._remote = self._remote, None
        try:
            self._loop_thread.run(remote.close())
        finally:
            self._loop_thread.stop()

    def __enter__(self) -> "MegatronLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
