"""Per-request sampling settings, validated once at the entry point so that engines never see bad values."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``termination_id`` of ``None`` means "the tokenizer's EOS ids"; the engine fills them in.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_tokens_to_generate: int = 16
    stop_words: list[str] = field(default_factory=list)
    termination_id: int | list[int] | None = None
    ignore_eos: bool = False
    return_log_probs: bool = False
    top_n_logprobs: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field whose value is unusable."""
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_int("top_k", self.top_k, minimum=0)
        _check_number("top_p", self.top_p, minimum=0.0, maximum=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("num_tokens_to_generate", self.num_tokens_to_generate, minimum=1)
        if isinstance(self.stop_words, str) or not isinstance(self.stop_words, (list, tuple)):
            raise ValueError(f"stop_words must be a list of strings, got {self.stop_words!r}")
        for word in self.stop_words:
            if not isinstance(word, str) or not word:
                raise ValueError(f"stop_words must hold non-empty strings, got {word!r}")
        self.stop_words = list(self.stop_words)
        if self.termination_id is not None:
            ids = self.termination_id if isinstance(self.termination_id, (list, tuple)) else [self.termination_id]
            for token_id in ids:
                _check_int("termination_id", token_id, minimum=0)
            if isinstance(self.termination_id, tuple):
                self.termination_id = list(self.termination_id)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.return_log_probs, bool):
            raise ValueError(f"return_log_probs must be a bool, got {self.return_log_probs!r}")
        _check_int("top_n_logprobs", self.top_n_logprobs, minimum=0, maximum=20)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.ignore_eos and self.termination_id is not None:
            raise ValueError("termination_id contradicts ignore_eos=True: give one or the other")

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the wire (a field copy: ``dataclasses.asdict`` deep-copies and is slow per request)."""
        data = {name: getattr(self, name) for name in _FIELD_NAMES}
        data["stop_words"] = list(self.stop_words)
        if isinstance(self.termination_id, list):
            data["termination_id"] = list(self.termination_id)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a wire/HTTP dict; unknown keys are an error, not silently ignored."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)

    @property
    def is_greedy(self) -> bool:
        """Temperatures this small make sampling numerically meaningless: they decode greedily."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))


def _check_number(name: str, value: Any, minimum: float | None = None, maximum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_number(name, value, minimum, maximum)
