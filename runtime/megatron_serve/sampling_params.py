"""Per-request sampling settings, validated once at the entry point so that engines never see bad values."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


GREEDY_TEMPERATURE = 1e-5
#: OpenAI's range for ``logit_bias`` values, and for presence and frequency penalties.
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language: exactly one of the fields is set.

    ``json``: a JSON schema (dict or its text); ``json_object``: any JSON object; ``regex``: a regular
    expression (Rust ``regex`` syntax); ``choice``: one of these strings; ``grammar``: a context-free
    grammar in GBNF/EBNF (``root ::= ...``) or Lark syntax. The engine decodes only tokens that keep
    the output a prefix of the language, and stops once it is complete (see ``structured_output``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar"
                             f" (got {', '.join(given) or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {self.json!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: getattr(self, self.kind)}


_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
    # Extensions of the OpenAI/vLLM surface; every default is neutral (output unchanged).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    return_prompt_log_probs: bool = False
    structured_outputs: StructuredOutputsParams | None = None

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
        self._validate_extensions()

    def _validate_extensions(self) -> None:
        _check_number("presence_penalty", self.presence_penalty, minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
        _check_number("frequency_penalty", self.frequency_penalty, minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token_id, minimum=0)
                _check_number("logit_bias value", bias, minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        _check_number("min_p", self.min_p, minimum=0.0, maximum=1.0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.num_tokens_to_generate:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds num_tokens_to_generate "
                             f"({self.num_tokens_to_generate})")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.return_prompt_log_probs, bool):
            raise ValueError(f"return_prompt_log_probs must be a bool, got {self.return_prompt_log_probs!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")

    @property
    def has_logits_controls(self) -> bool:
        """Whether any control changes the logits before sampling (all neutral: the step skips that work)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the wire (a field copy: ``dataclasses.asdict`` deep-copies and is slow per request).

        Extension fields at their neutral default are left out, so that a request that uses none of
        them reads the same to a peer that predates them. ``logit_bias`` travels as ``[id, bias]``
        pairs (the protocol's msgpack maps take string keys only).
        """
        data = {name: getattr(self, name) for name in _FIELD_NAMES}
        data["stop_words"] = list(self.stop_words)
        if isinstance(self.termination_id, list):
            data["termination_id"] = list(self.termination_id)
        for name, default in _EXTENSION_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        if "stop_token_ids" in data:
            data["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            data["logit_bias"] = [[token, bias] for token, bias in self.logit_bias.items()]
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a wire/HTTP dict; unknown keys are an error, not silently ignored."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        bias = data.get("logit_bias")
        if isinstance(bias, list):
            if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in bias):
                raise ValueError(f"logit_bias must be [token id, bias] pairs, got {bias!r}")
            data["logit_bias"] = {token: value for token, value in bias}
        return cls(**data)

    @property
    def is_greedy(self) -> bool:
        """Temperatures this small make sampling numerically meaningless: they decode greedily."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
_EXTENSION_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
    "min_p": 0.0, "min_tokens": 0, "stop_token_ids": [], "return_prompt_log_probs": False,
    "structured_outputs": None,
}


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
