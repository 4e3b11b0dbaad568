"""The table of sampling parameters: one row per field of ``SamplingParams``, read by everything that names them.

Per field: its name (the Python API's and the wire's), its type and neutral default, what values the engine
accepts, the HTTP field of ``/v1/completions`` and ``/v1/chat/completions`` that sets it (with the server's
description and, where it differs, its range), vLLM's and SGLang's names for it, the ``generation_config.json``
key whose value becomes its default, and the per-slot input the sampler reads it as. The readers:

* ``wire/sampling_params.py`` builds ``SamplingParams`` from the rows (one field each, its type and default) and
  checks every row's range and type;
* the HTTP server builds the request fields of the copied rows from the table (``server/models.py``; an
  extension's description is listed with the others in ``server/extensions.py``), copies them into
  ``SamplingParams`` in a loop (``server/translate.py``), and builds the sampling fields of vLLM's, SGLang's and TRL's
  bodies from the rows with their names (``server/rl/sampling_bodies.py``; verl's client renames by them);
* ``generation_config.py`` takes the defaults of the rows with a ``generation_config`` key;
* the engine keeps one per-slot vector per ``sampler`` input (``engine/sampling/sampling_state.py``), and the parity checker
  scores a request again with its ``FILTER`` rows (``engine/sampling/logprob_parity.py``).

So a new sampling parameter is a row here, the op that applies it (``engine/sampling/filters.py`` for a filter,
``engine/sampling/logits_processors.py`` for a penalty or control, the control row's tables in
``engine/sampling/sampling_state.py`` for one that is a fixed bias or mask, as ``allowed_token_ids``) and its test.
Standard library only: the HTTP server and the coordinator import it without torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

#: The stages a sampler input belongs to. A ``FILTER`` applies to sampled rows only and reads the row's logits
#: alone (temperature, top-k, top-p, min-p: a prompt's rows carry it, so the parity checker repeats it); a
#: ``PENALTY`` reads the tokens the request generated (the control tables' counts); a ``CONTROL`` reads the
#: request's own control rows (bias, stop tokens held back): penalties and controls apply to greedy rows too.
FILTER, PENALTY, CONTROL = "filter", "penalty", "control"

#: OpenAI's range for ``logit_bias`` values, and for presence and frequency penalties.
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
#: Most alternatives per token the engine returns (``top_n_logprobs``), as vLLM's default ``--max-logprobs``.
MAX_TOP_N_LOGPROBS = 20
#: Priorities fit a signed 32-bit integer (lower is admitted first; vLLM takes any int, no one needs more).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
#: Seeds are 64-bit signed integers in the OpenAI API (the engine's are their value modulo 2**63).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(enum.IntEnum):
    """vLLM's ``RequestOutputKind`` (``SamplingParams.output_kind``): what each ``RequestOutput`` of an iterated
    ``generate`` holds. An ``IntEnum`` (vLLM's is an ``Enum`` of the same values), so that the wire carries the
    number and comparisons read as in vLLM."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # only what is new since the last one
    FINAL_ONLY = 2  # nothing before the finished output


@dataclass(frozen=True)
class Bounds:
    """A range: ``minimum`` and ``maximum`` inclusive, ``above`` an exclusive minimum (``(above, maximum]``). For a
    string field of the HTTP API, the bounds of its length."""

    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None

    def pydantic(self, kind: type) -> dict[str, float]:
        """The pydantic ``Field`` constraints of these bounds."""
        if kind is str:
            return {key: value for key, value in (("min_length", self.minimum), ("max_length", self.maximum))
                    if value is not None}
        return {key: value for key, value in (("ge", self.minimum), ("gt", self.above), ("le", self.maximum))
                if value is not None}


@dataclass(frozen=True)
class SamplingField:
    """One sampling parameter (see the module docstring for who reads which column).

    ``copied``: the server copies the HTTP field's value (through ``from_http``) and a field the request leaves
    out takes the model's default, else ``default``; its request field is built from this row (``http_doc``,
    ``extension``, ``http_bounds`` or ``bounds``). Rows not copied are computed by the server from the request
    (``max_tokens`` against the context, ``stop`` as a list, the output constraint out of five fields...).
    """

    name: str
    # int, float, bool, str; ``list`` for token ids (each checked); ``object`` for other lists, maps and structs
    # (checked by SamplingParams itself)
    kind: type
    default: Any
    bounds: Bounds | None = None  # what SamplingParams accepts (numbers); None: any value of ``kind``
    http: str | None = None  # the request field of /v1/completions and /v1/chat/completions that sets it
    copied: bool = False
    from_http: Callable[[Any], Any] | None = None  # the HTTP value as SamplingParams takes it (copied rows)
    http_bounds: Bounds | None = None  # the request field's range, where it differs from ``bounds``
    http_doc: str | None = None  # the request field's description (an extension's: its entry in EXTENSIONS)
    extension: bool = False  # the HTTP field is none of OpenAI's (listed in ``server/extensions.py``)
    vllm: str | None = None  # vLLM's SamplingParams name (its /inference/v1/generate, TRL's generation_kwargs)
    sglang: str | None = None  # SGLang's ``sampling_params`` name
    generation_config: str | None = None  # the generation_config.json key whose value becomes the default
    sampler: str | None = None  # the per-slot vector the engine keeps of it (``SamplingState.vector``)
    stage: str | None = None  # FILTER, PENALTY or CONTROL: how the engine applies it (None: no logits op)
    annotation: str | None = None  # SamplingParams' type, where ``kind`` (or None) does not say it: a list, a map...
    # the type vLLM's and SGLang's sampling bodies (and the HTTP field) take it as, where not ``kind``: vLLM's
    # ``logprobs`` is a count, ``stop`` a string or a list (``server/rl/sampling_bodies.py`` builds the bodies)
    body: Any = None

    @property
    def request_bounds(self) -> Bounds | None:
        return self.http_bounds if self.http_bounds is not None else self.bounds

    @property
    def body_type(self) -> Any:
        """The type a framework's sampling body takes this field as."""
        return self.kind if self.body is None else self.body


def _float(value: Any) -> float:
    return float(value)


def _off_below_zero(top_k: int) -> int:
    return max(top_k, 0)  # vLLM's -1 and 0 both mean off


def _engine_seed(seed: int) -> int:
    return seed % 2**63  # OpenAI takes any 64-bit integer


_VLLM = " (vLLM's name)"

#: Every field of ``SamplingParams``, in its order.
FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", float, 1.0, Bounds(0.0), "temperature", True, _float, Bounds(0.0, 2.0),
                  "0 = greedy; default 1", vllm="temperature", sglang="temperature",
                  generation_config="temperature", sampler="temperature", stage=FILTER),
    SamplingField("top_k", int, 0, Bounds(0), "top_k", True, _off_below_zero, Bounds(-1),
                  "sample among the k most likely tokens; 0 or -1 = off" + _VLLM, extension=True, vllm="top_k",
                  sglang="top_k", generation_config="top_k", sampler="top_k", stage=FILTER),
    SamplingField("top_p", float, 1.0, Bounds(0.0, 1.0, above=0.0), "top_p", True, _float,
                  Bounds(maximum=1.0, above=0.0), "nucleus sampling mass; default 1 (off)", vllm="top_p",
                  sglang="top_p", generation_config="top_p", sampler="top_p", stage=FILTER),
    SamplingField("num_tokens_to_generate", int, 16, Bounds(1), "max_tokens", vllm="max_tokens",
                  sglang="max_new_tokens", generation_config="max_new_tokens"),
    SamplingField("stop_words", object, [], http="stop", vllm="stop", sglang="stop", annotation="list[str]",
                  body=str | list[str]),
    # the tokenizer's EOS ids, filled in by the engine
    SamplingField("termination_id", object, None, annotation="int | list[int] | None"),
    SamplingField("ignore_eos", bool, False, None, "ignore_eos", True,
                  http_doc="keep generating past end-of-sequence tokens" + _VLLM, extension=True, vllm="ignore_eos",
                  sglang="ignore_eos"),
    SamplingField("return_log_probs", bool, False, http="logprobs", vllm="logprobs", body=int),
    SamplingField("top_n_logprobs", int, 0, Bounds(0, MAX_TOP_N_LOGPROBS), "top_logprobs", vllm="logprobs"),
    SamplingField("seed", int, None, Bounds(0), "seed", True, _engine_seed, Bounds(SEED_MIN, SEED_MAX),
                  "makes sampling repeatable", vllm="seed", sglang="sampling_seed"),
    SamplingField("presence_penalty", float, 0.0, Bounds(-MAX_PENALTY, MAX_PENALTY), "presence_penalty", True,
                  _float, http_doc="subtracted from the logit of every token already generated; default 0",
                  vllm="presence_penalty", sglang="presence_penalty", sampler="presence", stage=PENALTY),
    SamplingField("frequency_penalty", float, 0.0, Bounds(-MAX_PENALTY, MAX_PENALTY), "frequency_penalty", True,
                  _float, http_doc="subtracted from a token's logit once per time it was generated; default 0",
                  vllm="frequency_penalty", sglang="frequency_penalty", sampler="frequency", stage=PENALTY),
    SamplingField("repetition_penalty", float, 1.0, Bounds(maximum=100.0, above=0.0), "repetition_penalty", True,
                  _float, http_doc="divides positive (and multiplies negative) logits of prompt and generated "
                                   "tokens; 1 = off" + _VLLM,
                  extension=True, vllm="repetition_penalty", sglang="repetition_penalty",
                  generation_config="repetition_penalty", sampler="repetition", stage=PENALTY),
    SamplingField("logit_bias", object, None, http="logit_bias", vllm="logit_bias", sglang="logit_bias",
                  stage=CONTROL, annotation="dict[int, float] | list[tuple[int, float]] | None",
                  body=dict[str, float]),
    SamplingField("min_p", float, 0.0, Bounds(0.0, 1.0), "min_p", True, _float,
                  http_doc="drop tokens less likely than min_p times the most likely one; 0 = off" + _VLLM,
                  extension=True, vllm="min_p", sglang="min_p", generation_config="min_p", sampler="min_p",
                  stage=FILTER),
    SamplingField("min_tokens", int, 0, Bounds(0), "min_tokens", True,
                  http_doc="no end-of-sequence token, stop token or stop string before this many tokens" + _VLLM,
                  extension=True, vllm="min_tokens", sglang="min_new_tokens", sampler="min_tokens", stage=CONTROL),
    SamplingField("stop_token_ids", list, [], http="stop_token_ids", vllm="stop_token_ids",
                  sglang="stop_token_ids", annotation="list[int]", body=list[int]),
    SamplingField("return_prompt_log_probs", bool, False, http="prompt_logprobs", vllm="prompt_logprobs", body=int),
    SamplingField("structured_outputs", object, None, http="structured_outputs", vllm="structured_outputs",
                  annotation="StructuredOutputsParams | None", body=dict[str, Any]),
    SamplingField("return_routing_indices", bool, False, None, "return_routing_indices", True,
                  http_doc="mixture-of-experts models: add routing_indices (the experts every processed token of "
                           "prompt and answer was routed to) to each choice", extension=True),
    # SGLang with slime's top-p patch (``custom_params.return_top_p_token_ids``): per generated token, the ids its
    # filters kept, and the log probs renormalized over them (no HTTP field: SGLang's /generate sets it)
    SamplingField("return_top_p_token_ids", bool, False),
    SamplingField("n", int, 1, Bounds(1), "n", vllm="n", sglang="n"),
    SamplingField("sample_index", int, 0, Bounds(0)),  # the choice: the server's, the Python API's
    SamplingField("truncate_prompt_tokens", int, None, Bounds(1), "truncate_prompt_tokens",
                  vllm="truncate_prompt_tokens"),
    SamplingField("priority", int, 0, Bounds(PRIORITY_MIN, PRIORITY_MAX), "priority", True,
                  http_doc="admission order when the engines are full: lower values first, then arrival; default 0 "
                           "(vLLM's name, as with --scheduling-policy priority)", extension=True),
    SamplingField("cache_salt", str, None, None, "cache_salt", True, http_bounds=Bounds(1, 1024),
                  http_doc="isolates prefix-cache entries: a request reuses cached KV blocks only of requests with "
                           "the same salt (or, without one, of unsalted requests), so tenants cannot probe each "
                           "other's prompts through cache timing; use a long random secret per tenant" + _VLLM,
                  extension=True),
    SamplingField("lora_name", str, None, http="model"),  # the served name a request's model picks
    SamplingField("lora_path", str, None),
    SamplingField("skip_special_tokens", bool, True, None, "skip_special_tokens", True,
                  http_doc="leave special tokens' text out of the output; default true" + _VLLM, extension=True,
                  vllm="skip_special_tokens", sglang="skip_special_tokens"),
    SamplingField("include_stop_str_in_output", bool, False, None, "include_stop_str_in_output", True,
                  http_doc="end the text after the stop string that ended it instead of before; default false"
                           + _VLLM, extension=True, vllm="include_stop_str_in_output", sglang="no_stop_trim"),
    # whose request: set by the server from its API key (wire/tenancy.py)
    SamplingField("tenant", object, None, annotation="TenantTag | None"),
    # What an iterated generate yields (vLLM's RequestOutputKind: 0 cumulative, 1 deltas, 2 the final output only):
    # the Python API's side only, as in vLLM, where the HTTP server picks it by ``stream``.
    SamplingField("output_kind", int, RequestOutputKind.CUMULATIVE, Bounds(0, 2), vllm="output_kind"),
    SamplingField("allowed_token_ids", list, None, http="allowed_token_ids", copied=True,
                  http_doc="only these token ids may be generated: every other token's logit is masked out, greedy "
                           "rows' too" + _VLLM, extension=True, vllm="allowed_token_ids", stage=CONTROL,
                  annotation="list[int] | None", body=list[int]),
    SamplingField("typical_p", float, 1.0, Bounds(0.0, 1.0, above=0.0), "typical_p", True, _float,
                  Bounds(maximum=1.0, above=0.0),
                  http_doc="locally typical sampling: keep the tokens whose surprisal is nearest the entropy until "
                           "their mass reaches typical_p; 1 = off (transformers', TGI's and llama.cpp's name)",
                  extension=True, sampler="typical_p", stage=FILTER),
)

BY_NAME: dict[str, SamplingField] = {field.name: field for field in FIELDS}
#: The rows the HTTP server copies from a request field of the same meaning.
COPIED: tuple[SamplingField, ...] = tuple(field for field in FIELDS if field.copied)
#: The rows the engine keeps a per-slot vector of, by stage.
SAMPLER_INPUTS: tuple[SamplingField, ...] = tuple(field for field in FIELDS if field.sampler is not None)
FILTERS: tuple[SamplingField, ...] = tuple(field for field in FIELDS if field.stage == FILTER)
PENALTIES: tuple[SamplingField, ...] = tuple(field for field in FIELDS if field.stage == PENALTY)
#: The filters that keep a subset of the vocabulary (temperature only rescales it): a sampled request that sets one and
#: asks ``return_top_p_token_ids`` gets the ids they kept and its log probs renormalized over them (slime's top-p patch
#: of SGLang reports neither for a request without top-k, top-p or min-p).
SUBSET_FILTERS: tuple[SamplingField, ...] = tuple(field for field in FILTERS if field.name != "temperature")
#: What changes the logits before sampling from the request's own history or tables (penalties and controls).
LOGITS_CONTROLS: tuple[SamplingField, ...] = tuple(field for field in FIELDS if field.stage in (PENALTY, CONTROL))
#: generation_config.json key -> SamplingParams field, for the sampling keys vLLM reads.
GENERATION_CONFIG_KEYS: dict[str, str] = {field.generation_config: field.name for field in FIELDS
                                          if field.generation_config is not None}
#: The HTTP descriptions of the copied extensions (``server/extensions.py`` lists them with the others).
EXTENSION_DOCS: dict[str, str] = {field.http: field.http_doc for field in COPIED
                                  if field.extension and field.http is not None and field.http_doc is not None}


def copied_from_http(request: Any) -> dict[str, Any]:
    """The copied rows' values of an HTTP request (any object with their HTTP fields as attributes), as
    ``SamplingParams`` fields; a field the request leaves out (``None``) is left out, for the defaults to fill."""
    values = {}
    for field in COPIED:
        value = getattr(request, field.http)  # type: ignore[arg-type] - copied rows have an HTTP field
        if value is not None:
            values[field.name] = value if field.from_http is None else field.from_http(value)
    return values


def differs_from_default(params: Any, fields: tuple[SamplingField, ...]) -> bool:
    """Whether any of ``fields`` of ``params`` is not its neutral default."""
    return any(getattr(params, field.name) != field.default for field in fields)
