"""The facts about a model directory that the server checks requests against, read once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    """``name``: the served model name; ``vocab_size`` / ``max_model_len``: for 400s on bad prompts."""

    name: str
    vocab_size: int | None
    max_model_len: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path, served_name: str | None = None) -> "ModelFacts":
        """Read ``config.json`` (the same parser the engine uses, so both agree on the context length)."""
        from ..model.config import ModelConfig  # noqa: PLC0415 - pulls in torch; only when a server starts

        path = Path(model_dir)
        config = ModelConfig.from_dir(path)
        return cls(served_name or default_model_name(path), config.vocab_size, config.max_context)


def default_model_name(model_dir: str | Path) -> str:
    """The directory's name, as vLLM and SGLang name a model served from a path; for a snapshot in the
    Hugging Face cache (``models--org--name/snapshots/<commit>``), the Hub id ``org/name``, as vLLM names
    a model served by its id."""
    path = Path(model_dir).expanduser().resolve()
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")  # Hub ids cannot hold "--" themselves
    return path.name or str(model_dir)
