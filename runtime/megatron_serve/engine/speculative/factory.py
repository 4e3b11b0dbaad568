"""The proposer a :class:`~megatron_serve.config.SpeculativeConfig` names, built once per engine."""

from __future__ import annotations

from pathlib import Path

from ...config import InferenceConfig
from .ngram import NgramProposer
from .proposer import Proposer


class SpeculativeConfigError(ValueError):
    """The speculative method cannot be served by this build or with this engine."""


def make_proposer(config: InferenceConfig, target_dir: str | Path | None = None) -> Proposer:
    """The proposer of ``config.speculative`` (which must be set). ``target_dir``: the target model's
    directory, when known, so a draft model of another vocabulary is refused at start.

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
    raise SpeculativeConfigError(f"speculative_config.method {spec.method!r} is not implemented yet")
