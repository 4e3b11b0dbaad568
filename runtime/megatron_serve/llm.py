"""``MegatronLLM``: the blocking Python API (DESIGN section 4).

Direct mode (``use_coordinator=False``) runs one engine in this process and steps it until the
batch is done. Coordinator mode talks to a fleet through the coordinator protocol.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from .config import InferenceConfig
from .engine import DynamicInferenceEngine
from .model.llama import LlamaForCausalLM
from .prompts import PromptInput, normalize_prompts
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


def make_requests(prompts: list, sampling_params: SamplingParams, tokenizer: Tokenizer,
                  ids: "itertools.count[int]") -> list[DynamicInferenceRequest]:
    requests = []
    for prompt in prompts:
        tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        requests.append(DynamicInferenceRequest(
            request_id=str(next(ids)), prompt=prompt if isinstance(prompt, str) else None,
            prompt_tokens=tokens, sampling_params=sampling_params,
        ))
    return requests


class MegatronLLM:
    def __init__(self, model: str | Path | LlamaForCausalLM, inference_config: InferenceConfig | None = None,
                 use_coordinator: bool = False, coordinator_address: str | None = None, num_engines: int = 1,
                 tokenizer: Tokenizer | str | Path | None = None, token: str | None = None):
        self.use_coordinator = use_coordinator
        self._ids = itertools.count()
        if use_coordinator:
            raise NotImplementedError("coordinator mode is not available yet")
        self.engine = build_engine(model, inference_config, tokenizer)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptInput, sampling_params: SamplingParams | None = None
                 ) -> list[DynamicInferenceRequest]:
        """Generate for every prompt; returns one finished request per prompt, in input order."""
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

    def pause(self) -> None:
        self._require_coordinator("pause")

    def unpause(self) -> None:
        self._require_coordinator("unpause")

    def suspend(self, level: int = 1) -> None:
        self._require_coordinator("suspend")

    def resume(self) -> None:
        self._require_coordinator("resume")

    def shutdown(self) -> None:
        """Direct mode holds no processes: nothing to stop."""

    def __enter__(self) -> "MegatronLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
