"""The proposer a :class:`~megatron_serve.config.SpeculativeConfig` names, and the engine's speculator over it, built
once per engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...config import InferenceConfig
from .decoder import Speculator
from .ngram import NgramProposer
from .proposer import Proposer

if TYPE_CHECKING:
    from ...model.llama import LlamaForCausalLM
    from ...wire.engine_stats import EngineStats


class SpeculativeConfigError(ValueError):
    """The speculative method cannot be served by this build or with this engine."""


def make_proposer(config: InferenceConfig, target_dir: str | Path | None = None,
                  target: "LlamaForCausalLM | None" = None) -> Proposer:
    """The proposer of ``config.speculative`` (which must be set). ``target_dir``: the target model's
    directory, when known, so a draft model of another vocabulary is refused at start (method ``mtp``
    reads its MTP layer there). ``target``: the served model (``mtp`` and ``eagle3`` use its embedding and hidden states).

    The draft model's module is imported only when that method is asked for (it loads a second model).
    """
    spec = config.speculative
    assert spec is not None, "make_proposer without a speculative config"
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from .draft_model import DraftModelProposer  # noqa: PLC0415 (loads a second model: only when asked for)

        assert spec.model is not None  # SpeculativeConfig requires it for draft_model
        return DraftModelProposer(spec.model, config, target_dir=target_dir)
    if spec.method == "mtp":
        from .mtp import MtpProposer  # noqa: PLC0415 (only when asked for)

        if target is None or target_dir is None:
            raise SpeculativeConfigError("speculative_config.method 'mtp' needs the target model and its directory")
        return MtpProposer(target, target_dir, config)
    if spec.method == "eagle3":
        from .eagle3 import Eagle3Proposer  # noqa: PLC0415 (only when asked for)

        if target is None:
            raise SpeculativeConfigError("speculative_config.method 'eagle3' needs the target model")
        assert spec.model is not None  # SpeculativeConfig requires it for eagle3
        return Eagle3Proposer(target, spec.model, config)
    raise SpeculativeConfigError(f"speculative_config.method {spec.method!r} is not implemented yet")


def make_speculator(config: InferenceConfig, model: "LlamaForCausalLM", stats: "EngineStats",
                    model_dir: str | Path | None = None) -> Speculator | None:
    """The engine's speculator (None without ``config.speculative``): its proposer (:func:`make_proposer`), timed
    by the clock of the model's device, and whether the engine may overlap its verify steps at all (overlapped
    scheduling, one rank, no images: :meth:`~.decoder.Speculator.overlaps`)."""
    spec = config.speculative
    if spec is None:
        return None
    overlap = config.async_scheduling and config.tensor_parallel_size == 1 and model.config.vision is None
    return Speculator(make_proposer(config, model_dir, model), spec.num_speculative_tokens, stats, spec.adaptive,
                      cpu=next(model.parameters()).device.type == "cpu", overlap=overlap)
