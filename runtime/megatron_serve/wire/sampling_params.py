"""Per-request sampling settings, validated once where they enter a process, so engines never see bad values.

``SamplingParams`` is a ``msgspec.Struct``: the same class is the Python API and the wire form (a
msgpack map of its fields, defaults left out). Each field is a row of the table of sampling parameters
(:mod:`.sampling_fields`: its default, range, HTTP field, vLLM and SGLang names, generation_config key,
sampler input): the struct is built from the rows, one field each with the row's type and default, and
:meth:`SamplingParams.validate` checks every row's type and range from the table (the checks that relate fields
stay here, in the methods the rows' struct inherits). Decoding checks
the types in C and then runs ``__post_init__``; building one in Python runs the same checks. Unknown fields
are an error, not silently ignored.

Building one in Python also takes vLLM's names (``max_tokens``, ``stop``, ``logprobs``,
``prompt_logprobs``, ``guided_decoding``, ``top_k=-1``) beside ours, so that code written for vLLM's
``SamplingParams`` runs unchanged (:data:`VLLM_NAMES`); giving both names of one setting with
different values is a ``ValueError`` naming both. The wire knows only our names.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .sampling_fields import (
    FIELDS,
    RequestOutputKind,
    LOGITS_CONTROLS,
    MAX_LOGIT_BIAS,
    PENALTIES,
    SamplingField,
    differs_from_default,
)

GREEDY_TEMPERATURE = 1e-5
#: What reported log probs are taken from (vLLM's ``--logprobs-mode``, an engine setting): ``raw``, the model's
#: logits; ``processed``, after logit bias, min_tokens, penalties, grammar, temperature, min-p, top-k and top-p;
#: as log probs or as logits.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


class SamplingParamError(ValueError):
    """A sampling parameter refused. ``field`` names it (this API's name) and the message begins with it, so
    a front end that speaks other names (OpenAI's ``max_tokens``) rewords it with :meth:`naming` instead of
    parsing the text."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason

    def naming(self, name: str) -> str:
        """The message with ``name`` for the field."""
        return f"{name} {self.reason}"


class UnknownSamplingParams(SamplingParamError):
    """Names that are no sampling parameter (``names``, sorted)."""

    def __init__(self, names: list[str]) -> None:
        ValueError.__init__(self, f"unknown sampling parameter(s): {', '.join(names)}")
        self.field = names[0]
        self.names = names
        self.reason = str(self)

    def naming(self, name: str) -> str:
        return str(self)


class MalformedSamplingParams(SamplingParamError):
    """Sampling parameters of the wrong type or shape, as the decoder words it (its path names the field)."""

    def __init__(self, reason: str) -> None:
        ValueError.__init__(self, reason)
        self.field = "sampling_params"
        self.reason = reason

    def naming(self, name: str) -> str:
        return self.reason


class StructuredOutputsParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Constrain a request's output to a language: exactly one of the fields is set.

    ``json``: a JSON schema (dict or its text); ``json_object``: any JSON object; ``regex``: a regular
    expression (Rust ``regex`` syntax); ``choice``: one of these strings; ``grammar``: a context-free
    grammar in GBNF/EBNF (``root ::= ...``) or Lark syntax. The engine decodes only tokens that keep
    the output a prefix of the language, and stops once it is complete (see ``structured_output``).
    On the wire it is ``{kind: value}`` (the unset fields are defaults, left out).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamError("structured_outputs", "must set exactly one of json, json_object, regex, choice, "
                                     f"grammar (got {', '.join(given) or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise SamplingParamError("structured_outputs.json",
                                     f"must be a JSON schema (object or string), got {self.json!r}")
        if self.json_object is not True and self.json_object is not False:
            raise SamplingParamError("structured_outputs.json_object", f"must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamError(f"structured_outputs.{name}", f"must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise SamplingParamError("structured_outputs.choice",
                                         f"must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: getattr(self, self.kind)}


#: The tenants' classes, best band first (wire.tenancy): a request's band is its class's index here.
TENANT_CLASSES = ("critical", "standard", "sheddable")


class TenantTag(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Whose request it is (wire.tenancy): the tenant's ``name``, its ``priority_class`` (one of
    :data:`TENANT_CLASSES`) and ``weight`` (its share of the tokens against the other tenants of its class)."""

    name: str = ""
    priority_class: str = "standard"
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or len(self.name) > 128:
            raise SamplingParamError("tenant", f"name must be a string of at most 128 characters, got {self.name!r:.60}")
        if self.priority_class not in TENANT_CLASSES:
            raise SamplingParamError("tenant", f"priority_class must be one of {', '.join(TENANT_CLASSES)}, got "
                                               f"{self.priority_class!r:.40}")
        _check_number("tenant", self.weight, what="weight")
        if not self.weight > 0:
            raise SamplingParamError("tenant", f"weight must be > 0, got {self.weight!r}")


_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class _VllmNames(type(msgspec.Struct)):  # type: ignore[misc]
    """The metaclass that lets ``SamplingParams(...)`` take vLLM's keyword names (decoding never sees them)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            kwargs = _ours(kwargs, set(cls.__struct_fields__))
        return super().__call__(*args, **kwargs)


def stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's and vLLM's ``stop``: one string, a list of them, or none."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def _merge(ours: dict[str, Any], name: str, value: Any, vllm_name: str) -> None:
    """Set ``ours[name] = value`` from vLLM's ``vllm_name``, unless ``name`` was also given with another value."""
    if name in ours and ours[name] != value:
        raise SamplingParamError(vllm_name, f"(vLLM's name) and {name} are the same setting and differ ({value!r} "
                                 f"vs {ours[name]!r}): give one")
    ours[name] = value


def _ours(kwargs: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """Keyword arguments with vLLM's names turned into ours; unknown names are a ``ValueError`` naming them."""
    ours = {k: v for k, v in kwargs.items() if k in fields}
    unknown = sorted(set(kwargs) - fields - set(VLLM_NAMES))
    if unknown:
        raise UnknownSamplingParams(unknown)
    if "max_tokens" in kwargs:
        _merge(ours, "num_tokens_to_generate", kwargs["max_tokens"], "max_tokens")
    if "stop" in kwargs:
        _merge(ours, "stop_words", stop_list(kwargs["stop"]), "stop")
    if kwargs.get("logprobs") is not None:
        _merge(ours, "return_log_probs", True, "logprobs")
        _merge(ours, "top_n_logprobs", max(kwargs["logprobs"], ours.get("top_n_logprobs", 0)), "logprobs")
    if kwargs.get("prompt_logprobs") is not None:
        _merge(ours, "return_prompt_log_probs", True, "prompt_logprobs")
        ours["top_n_logprobs"] = max(kwargs["prompt_logprobs"], ours.get("top_n_logprobs", 0))
    if kwargs.get("guided_decoding") is not None:
        _merge(ours, "structured_outputs", kwargs["guided_decoding"], "guided_decoding")
    if ours.get("top_k") == -1:  # vLLM's "off"
        ours["top_k"] = 0
    return ours


#: vLLM's keyword names that ``SamplingParams(...)`` takes -> what each sets here.
VLLM_NAMES: dict[str, str] = {
    "max_tokens": "num_tokens_to_generate",
    "stop": "stop_words (a string or a list of strings)",
    "logprobs": "return_log_probs=True and top_n_logprobs (the alternatives per generated token)",
    "prompt_logprobs": "return_prompt_log_probs=True and top_n_logprobs (one count serves prompt and output: the "
                       "larger of logprobs and prompt_logprobs)",
    "guided_decoding": "structured_outputs (vLLM's older name)",
}


class _SamplingParamsMethods(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, metaclass=_VllmNames):
    """What :class:`SamplingParams` does (its checks, vLLM's read-back names); its fields are the table's rows."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SamplingParamError` (a ``ValueError``) naming the first field whose value is unusable: every
        row's type and range as the table states them (:mod:`.sampling_fields`), then the lists, maps and structs,
        and the checks that relate fields."""
        for row in _CHECKED:
            _check_field(row, getattr(self, row.name))
        self.output_kind = RequestOutputKind(self.output_kind)  # read back as vLLM's enum
        if isinstance(self.stop_words, str) or not isinstance(self.stop_words, (list, tuple)):
            raise SamplingParamError("stop_words", f"must be a list of strings, got {self.stop_words!r}")
        for word in self.stop_words:
            if not isinstance(word, str) or not word:
                raise SamplingParamError("stop_words", f"must hold non-empty strings, got {word!r}")
        if isinstance(self.stop_words, tuple):
            self.stop_words = list(self.stop_words)
        if self.termination_id is not None:
            ids = self.termination_id if isinstance(self.termination_id, (list, tuple)) else [self.termination_id]
            for token_id in ids:
                _check_int("termination_id", token_id, minimum=0)
            if isinstance(self.termination_id, tuple):
                self.termination_id = list(self.termination_id)
        if self.ignore_eos and self.termination_id is not None:
            raise SamplingParamError("termination_id", "contradicts ignore_eos=True: give one or the other")
        self._validate_collections()

    def _validate_collections(self) -> None:
        if self.logit_bias is not None:
            bias = self.logit_bias
            if isinstance(bias, (list, tuple)):
                if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in bias):
                    raise SamplingParamError("logit_bias", f"must be [token id, bias] pairs, got {bias!r}")
                bias = dict(bias)
            if not isinstance(bias, dict):
                raise SamplingParamError("logit_bias", f"must map token ids to numbers, got {bias!r}")
            for token_id, value in bias.items():
                _check_int("logit_bias", token_id, minimum=0, what="token id")
                _check_number("logit_bias", value, minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS, what="value")
            self.logit_bias = {int(t): float(b) for t, b in bias.items()} or None
        if self.min_tokens > self.num_tokens_to_generate:
            # vLLM's words and public name (``num_tokens_to_generate`` is ``max_tokens`` everywhere a user writes it)
            raise SamplingParamError("min_tokens", f"must be less than or equal to max_tokens="
                                                   f"{self.num_tokens_to_generate}, got {self.min_tokens}")
        for row in _TOKEN_LISTS:
            setattr(self, row.name, _token_list(row, getattr(self, row.name)))
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamError("structured_outputs", f"must be StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.lora_path is not None and self.lora_name is None:
            raise ValueError("lora_path needs lora_name")
        if isinstance(self.tenant, dict):
            self.tenant = TenantTag(**self.tenant)
        if self.tenant is not None and not isinstance(self.tenant, TenantTag):
            raise SamplingParamError("tenant", f"must be a TenantTag, got {self.tenant!r:.60}")

    def choices(self) -> list["SamplingParams"]:
        """The parameters of the ``n`` requests these stand for: ``n`` 1, no truncation left to apply, and
        sample indices 0, 1, ...: with one seed, choice ``i`` draws its own stream keyed on (seed, i, position)
        (as the HTTP server's choices do)."""
        return [msgspec.structs.replace(self, n=1, truncate_prompt_tokens=None, sample_index=choice)
                for choice in range(self.n)]

    # vLLM's names, read back
    @property
    def max_tokens(self) -> int:
        return self.num_tokens_to_generate

    @property
    def stop(self) -> list[str]:
        return list(self.stop_words)

    @property
    def logprobs(self) -> int | None:
        return self.top_n_logprobs if self.return_log_probs else None

    @property
    def prompt_logprobs(self) -> int | None:
        return self.top_n_logprobs if self.return_prompt_log_probs else None

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the tokens generated so far (presence, frequency, repetition)."""
        return differs_from_default(self, PENALTIES)

    @property
    def has_logits_controls(self) -> bool:
        """Whether any control changes the logits before sampling (all neutral: the step skips that work)."""
        return differs_from_default(self, LOGITS_CONTROLS)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists copied): every base field, and the extensions that are not neutral."""
        data = {name: getattr(self, name) for name in _BASE_FIELDS}
        data["stop_words"] = list(self.stop_words)
        if isinstance(self.termination_id, list):
            data["termination_id"] = list(self.termination_id)
        extensions = msgspec.to_builtins(self)  # defaults (neutral values) left out
        data.update((name, extensions[name]) for name in _EXTENSION_FIELDS if name in extensions)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a dict (HTTP body, older callers); ``ValueError`` naming the field, unknown keys included."""
        try:
            return msgspec.convert(data or {}, cls)
        except msgspec.ValidationError as exc:
            raise _typed_error(exc, data) from None

    @property
    def is_greedy(self) -> bool:
        """Temperatures this small make sampling numerically meaningless: they decode greedily."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _annotation(row: SamplingField) -> Any:
    """The type ``SamplingParams`` declares for ``row``: its ``annotation`` where the table gives one (lists, maps,
    structs: text, resolved in this module), else its ``kind``, which may be None where the default is."""
    if row.annotation is not None:
        return row.annotation
    return row.kind | None if row.default is None else row.kind


def _derived(name: str, doc: str) -> type[_SamplingParamsMethods]:
    """The struct of one field per row of the table, in its order, with its default (an empty list's is copied per
    instance, as msgspec does for empty collections): a new sampling parameter is its row, not a line here too."""
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": name, "__doc__": doc,
                                 "__annotations__": {row.name: _annotation(row) for row in FIELDS}}
    namespace.update((row.name, row.default) for row in FIELDS)
    return _VllmNames(name, (_SamplingParamsMethods,), namespace)


SamplingParams = _derived("SamplingParams", """How one request samples and when it stops: one field per row of
:data:`~.sampling_fields.FIELDS` (its name, type and default; the row says what each means).

``termination_id`` of ``None`` means "the tokenizer's EOS ids"; the engine fills them in. vLLM's names are taken
too (module docstring); ``max_tokens``, ``stop``, ``logprobs`` and ``prompt_logprobs`` also read back as in vLLM.
``n``, ``truncate_prompt_tokens``: applied by ``MegatronLLM``/``MegatronAsyncLLM`` (``n`` requests per prompt, the
prompt's last tokens); one request on the wire runs one sequence of its whole prompt, so a ``SUBMIT`` carrying
either is refused. Every default is neutral (output unchanged) and stays off the wire, so a request that uses no
extension reads the same to a peer that predates them. ``logit_bias`` also reads as ``[id, bias]`` pairs.""")


_BASE_FIELDS = SamplingParams.__struct_fields__[:SamplingParams.__struct_fields__.index("presence_penalty")]
_EXTENSION_FIELDS = SamplingParams.__struct_fields__[len(_BASE_FIELDS):]
_WIRE = msgspec.msgpack.Decoder(SamplingParams)
_DEFAULTS_WIRE = b"\x80"  # an empty msgpack map


def params_from_wire(data: bytes) -> tuple[SamplingParams, bytes]:
    """Sampling parameters from their msgpack (empty or nil: the defaults), and the bytes to forward.

    ``ValueError`` naming the field when they are unusable, or when they ask for what one request
    cannot do (``n`` > 1, ``truncate_prompt_tokens``: the Python API and the HTTP server apply those).
    """
    if not data or data == b"\xc0":
        return SamplingParams(), _DEFAULTS_WIRE
    try:
        params = _WIRE.decode(data)
    except msgspec.ValidationError as exc:
        raise _typed_error(exc, data) from None
    except msgspec.DecodeError as exc:
        raise MalformedSamplingParams(f"sampling_params: {exc}") from None
    if params.n != 1 or params.truncate_prompt_tokens is not None:
        field = "n" if params.n != 1 else "truncate_prompt_tokens"
        raise SamplingParamError(field, "is not for one request's sampling_params: one request runs one sequence of "
                                        "its whole prompt; MegatronLLM.generate and the HTTP server apply n and "
                                        "truncate_prompt_tokens")
    return params, data


class SharedParams:
    """:func:`params_from_wire` remembering what it read: clients send the same few parameter sets over
    and over, and decoding them with the struct's checks was a sixth of the coordinator's CPU per request
    (``benchmarks/coordinator_core.py``). The instances are shared between requests, so only for a reader that never
    changes them (the coordinator; an engine fills in ``termination_id``). Bad bytes are never kept."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._known: dict[bytes, tuple[SamplingParams, bytes]] = {}

    def read(self, data: bytes) -> tuple[SamplingParams, bytes]:
        known = self._known.get(data)
        if known is None:
            known = params_from_wire(data)
            if len(self._known) >= self.size:
                self._known.clear()
            self._known[data] = known
        return known


def _typed_error(exc: msgspec.ValidationError, data: dict[str, Any] | bytes | None) -> SamplingParamError:
    """The typed error behind a decoder's refusal: a check's own (its cause), unknown names (found by comparing
    the keys with the fields, never by reading the decoder's words), or the decoder's type error."""
    if isinstance(exc.__cause__, SamplingParamError):
        return exc.__cause__
    if isinstance(data, bytes):
        try:
            data = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            data = None
    if isinstance(data, dict):
        unknown = sorted(str(key) for key in data if key not in SamplingParams.__struct_fields__)
        if unknown:
            return UnknownSamplingParams(unknown)
    return MalformedSamplingParams(str(exc))


#: The rows whose type (and range) the table states: numbers, flags and strings.
_CHECKED = tuple(row for row in FIELDS if row.kind in (int, float, bool, str))
_TOKEN_LISTS = tuple(row for row in FIELDS if row.kind is list)


def _token_list(row: SamplingField, value: Any) -> list[int] | None:
    """A row of token ids (``kind`` list): a list (a tuple is taken) of token ids. One whose default is None (a
    restriction asked for) may not be empty, as vLLM refuses an empty ``allowed_token_ids``."""
    if value is None and row.default is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise SamplingParamError(row.name, f"must be a list of token ids, got {value!r}")
    if not value and row.default is None:
        raise SamplingParamError(row.name, "must name at least one token id, got an empty list")
    for token_id in value:
        _check_int(row.name, token_id, minimum=0)
    return list(value)


def _check_field(row: SamplingField, value: Any) -> None:
    """One row's type and range as the table states them; a field whose default is None may be None."""
    name = row.name
    if value is None and row.default is None:
        return
    if row.kind is bool:
        if value is not True and value is not False:
            raise SamplingParamError(name, f"must be a bool, got {value!r}")
    elif row.kind is str:
        if not isinstance(value, str) or not value:
            raise SamplingParamError(name, f"must be a non-empty string, got {value!r}")
    else:
        minimum, maximum, above = (row.bounds.minimum, row.bounds.maximum, row.bounds.above) if row.bounds \
            else (None, None, None)
        (_check_int if row.kind is int else _check_number)(name, value, minimum, maximum)
        if above is not None and value <= above:
            raise SamplingParamError(name, f"must be in ({above:g}, {maximum:g}], got {value}")


def _check_number(name: str, value: Any, minimum: float | None = None, maximum: float | None = None,
                  what: str = "") -> None:
    """Refuse ``value`` for field ``name`` unless a number in range (``what``: which part of the field)."""
    lead = f"{what} " if what else ""
    if value is True or value is False or not isinstance(value, (int, float)):
        raise SamplingParamError(name, f"{lead}must be a number, got {value!r}")
    if value != value:  # NaN
        raise SamplingParamError(name, f"{lead}must be a number, got NaN")
    if minimum is not None and value < minimum:
        raise SamplingParamError(name, f"{lead}must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SamplingParamError(name, f"{lead}must be <= {maximum}, got {value}")


def _check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None,
               what: str = "") -> None:
    if value is True or value is False or not isinstance(value, int):
        raise SamplingParamError(name, f"{what} must be an integer, got {value!r}" if what
                                 else f"must be an integer, got {value!r}")
    _check_number(name, value, minimum, maximum, what)
