"""The model's own sampling defaults (``generation_config.json``), applied where a request is silent.

Model authors ship recommended settings (Qwen3: temperature 0.6, top_p 0.95, top_k 20) in
``generation_config.json``. As in vLLM (``--generation-config auto``, its default), those values
become the defaults of every request that does not set the field itself: the OpenAI server's
requests, ``MegatronLLM.generate`` / ``MegatronAsyncLLM.generate`` called without
``SamplingParams``, and ``megatron-serve generate``. ``none`` ignores the file (vLLM calls that
``vllm``, also accepted); a directory reads that directory's ``generation_config.json`` instead.

Every sampling key vLLM reads has a ``SamplingParams`` field here (its row of ``wire/sampling_fields.py`` names
the key), so each one is applied, and the commands log what they apply at start-up. ``max_new_tokens`` is the default of ``max_tokens``; a
request's own ``max_tokens`` wins (vLLM caps it instead; OpenAI clients expect what they ask for).
``do_sample`` is not read, as in vLLM: a temperature in the file is taken as given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .wire.sampling_fields import GENERATION_CONFIG_KEYS
from .wire.sampling_params import SamplingParams

FILENAME = "generation_config.json"
AUTO = "auto"
NONE = ("none", "vllm")



@dataclass(frozen=True)
class GenerationDefaults:
    """``values``: SamplingParams field -> default; ``source``: the file they came from."""

    values: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    source: Path | None = None

    @classmethod
    def load(cls, setting: str | os.PathLike | None, model_dir: str | os.PathLike | None) -> "GenerationDefaults":
        """The defaults that ``--generation-config setting`` selects for the model in ``model_dir``.

        ``auto`` (and ``None``): the model's file if it has one; ``none``/``vllm``: no defaults; else a
        directory that must hold the file. A file with unusable values raises ``ValueError`` naming it.
        """
        text = AUTO if setting is None else str(setting)
        if text.lower() in NONE:
            return cls()
        if text.lower() == AUTO:
            if model_dir is None or not (Path(model_dir) / FILENAME).is_file():
                return cls()
            return cls.from_file(Path(model_dir) / FILENAME)
        path = Path(text).expanduser()
        if not (path / FILENAME).is_file():
            raise FileNotFoundError(f"--generation-config {text}: expected 'auto', 'none' or a directory holding "
                                    f"{FILENAME}, and {path / FILENAME} does not exist")
        return cls.from_file(path / FILENAME)

    @classmethod
    def from_file(cls, path: Path) -> "GenerationDefaults":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")
        values = {GENERATION_CONFIG_KEYS[key]: value for key, value in data.items()
                  if key in GENERATION_CONFIG_KEYS and value is not None}
        try:
            SamplingParams(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc} (pass --generation-config none to ignore the file)") from None
        return cls(MappingProxyType(values), path)

    def get(self, name: str, fallback: Any) -> Any:
        """The default of SamplingParams field ``name``, else ``fallback``."""
        return self.values.get(name, fallback)

    def sampling_params(self, **explicit: Any) -> SamplingParams:
        """``SamplingParams`` from these defaults, overridden by every ``explicit`` value that is not ``None``."""
        return SamplingParams(**{**self.values, **{k: v for k, v in explicit.items() if v is not None}})

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.source is None:
            return "generation defaults: none (requests' own values, else OpenAI's defaults)"
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.values.items())) or "nothing this engine applies"
        return f"generation defaults from {self.source}: {shown}"
