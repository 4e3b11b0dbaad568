"""``vllm serve``'s options, as one table: implemented here, accepted and changing nothing, or refused.

Every row is (vLLM's option, status, reason), with the argparse keywords of the options this table defines; the rows
are data, in ``vllm_options.yaml`` beside this module (its header says the keys), read once at import. The table
drives:

* the parsers: :func:`add_vllm_options` adds the rows that carry a ``spec`` to the commands of their
  scope (HTTP-server options to ``run``, ``serve`` and ``server``; engine options to ``run``,
  ``serve``, ``engine`` and ``generate``). Rows without a spec name an option the commands define
  themselves, under vLLM's name or as an alias (:mod:`.aliases`);
* the start-up warnings: :func:`accepted_warnings` gives one line per accepted option given, saying
  why it changes nothing here (never silently ignored; the CLI prints them before the command runs);
* the flag table of ``docs/vllm-mapping.md`` (``tools/generate_docs.py``);
* the keywords of the Python ``LLM(...)`` (each option is also vLLM's ``LLM`` keyword: ``--swap-space`` is
  ``swap_space=``), in :mod:`megatron_serve.client.vllm_args`: which is why the table lives in the client.

A refused option is parsed too, so that its error says why (with the command's usage) instead of
"unrecognized arguments". ``tests/commands/test_vllm_options.py`` parses every row and starts
``serve`` once with the implemented options and once with the accepted ones.

Options other work adds (``--stream-interval``, the CUDA-graph capture sizes) become rows here.
"""

from __future__ import annotations

import argparse
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import yaml

from ..http_options import TOOL_CALL_PARSERS
from ..wire.kv_events import KV_OFFLOADING_BACKENDS, KVEventsConfig, parse_kv_events_config

class Status(enum.Enum):
    IMPLEMENTED = "implemented"  # with vLLM's meaning (under its name, or as an alias of ours)
    ACCEPTED = "accepted"  # parsed, changes nothing here; a start-up warning says why
    REFUSED = "refused"  # parsed and refused with the reason


class Scope(enum.Enum):
    SERVER = "server"  # the OpenAI server's options: run, serve, server
    ENGINE = "engine"  # the engines' options: run, serve, engine, generate


#: ``--quantization`` values that serve the checkpoint's weights as they are ("auto"/"none": an FP8 checkpoint's
#: included; "gguf", vLLM's for a GGUF file: its weights, dequantized at load).
CHECKPOINT_QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "gguf")
#: ``--quantization`` values this build implements ("fp8": a float checkpoint's linear layers quantized at load).
QUANTIZATION_SCHEMES: tuple[str, ...] = (*CHECKPOINT_QUANTIZATIONS, "fp8")
#: ``--kv-cache-dtype`` values this build implements ("auto": the model's dtype; "fp8" is e4m3).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
#: ``--all2all-backend`` values this build implements ("auto" and "alltoall" are this project's; vLLM's "naive",
#: "pplx", "mori", "nixl_ep" and "flashinfer_*" are refused, naming them).
#: ``--weight-transfer-config`` backends: vLLM's ``nccl``, and ``gloo`` (this project's name) for CPU trainers.
WEIGHT_TRANSFER_BACKENDS: tuple[str, ...] = ("nccl", "gloo")
ALL2ALL_BACKENDS: tuple[str, ...] = ("auto", "alltoall", "allgather_reducescatter", "deepep_high_throughput",
                                     "deepep_low_latency")


def _supported(flag: str, values: tuple[str, ...], why: str) -> Callable[[str], str]:
    """An argparse ``type`` accepting ``values`` only; others are refused naming the flag and why."""
    def parse(value: str) -> str:
        if value not in values:
            raise argparse.ArgumentTypeError(f"{value!r} is not supported by this build (supported: "
                                             f"{', '.join(values)}): {why}")
        return value

    parse.__name__ = flag.removeprefix("--").replace("-", "_")
    return parse


def _positive_float(flag: str) -> Callable[[str], float]:
    """An argparse ``type`` for a positive number; others are refused naming the flag."""
    def parse(value: str) -> float:
        number = _converted(value, float, "a number")
        if not number > 0 or number == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number, got {value!r}")
        return number

    parse.__name__ = flag.removeprefix("--").replace("-", "_")
    return parse


def _json_list(value: str) -> list[str]:
    """vLLM's CORS lists: a JSON list of strings (``'["https://a.example"]'``), or one bare item."""
    text = value.strip()
    if not text.startswith("["):
        return [text]
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise argparse.ArgumentTypeError("must be a JSON list of non-empty strings")
    return items


def _lora_module(value: str) -> tuple[str, str]:
    """``--lora-modules`` items, as vLLM takes them: ``name=path`` or ``{"name": ..., "path": ...}`` (JSON; its
    ``base_model_name`` is the served model here)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
        if not isinstance(item, dict) or set(item) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError("a JSON item takes name, path and base_model_name only")
        name, path = item.get("name"), item.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
    return name, path


def _json_object(value: str) -> dict[str, Any]:
    """``--speculative-config``: vLLM's JSON object (its fields are checked where the engine's config is built,
    each bad one named)."""
    try:
        item = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return item


def _kv_events_config(value: str) -> KVEventsConfig:
    """``--kv-events-config``: vLLM's JSON object, every field checked (an unknown one named)."""
    try:
        return parse_kv_events_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events-config: ")) from None


def _weight_transfer_config(value: str) -> dict[str, Any]:
    """``--weight-transfer-config``: vLLM's JSON object, whose one field is ``backend``."""
    item = _json_object(value)
    if set(item) != {"backend"} or item["backend"] not in WEIGHT_TRANSFER_BACKENDS:
        raise argparse.ArgumentTypeError(f"{value!r}: expected {{\"backend\": \"nccl\"}} or {{\"backend\": \"gloo\"}}")
    return item


def _converted(value: str, kind: Callable[[str], Any], what: str) -> Any:
    """``kind(value)``, or argparse's error saying ``value`` is not ``what``."""
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not {what}") from None


def _positive(value: str) -> int:
    number = _converted(value, int, "an integer")
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: must be a positive integer")
    return number


@dataclass(frozen=True)
class VllmOption:
    """One option of ``vllm serve`` and what it does here."""

    flags: tuple[str, ...]  # vLLM's spellings, its name first
    status: Status
    reason: str  # what it does here, or why it changes nothing, or why it is refused
    ours: str | None = None  # our option with the same effect, when it has another name
    spec: Mapping[str, Any] | None = None  # argparse keywords, when this table defines the option
    scope: Scope | None = None  # the commands a defined option is added to
    example: tuple[str, ...] = ()  # arguments a test passes ({model}, {port}, {tmp}: filled in by the test)

    @property
    def name(self) -> str:
        return self.flags[0]

    @property
    def dest(self) -> str:
        return (self.spec or {}).get("dest") or self.name.removeprefix("--").replace("-", "_")


#: The named values the table's rows refer to (choices, a ``supported`` row's values, ``$NAME`` in a reason).
_NAMED_VALUES: dict[str, tuple[str, ...]] = {
    "TOOL_CALL_PARSERS": TOOL_CALL_PARSERS, "QUANTIZATION_SCHEMES": QUANTIZATION_SCHEMES,
    "KV_CACHE_DTYPES": KV_CACHE_DTYPES, "ALL2ALL_BACKENDS": ALL2ALL_BACKENDS,
    "KV_OFFLOADING_BACKENDS": KV_OFFLOADING_BACKENDS,
}
#: A row's ``spec.type`` by name (``positive_float`` names the row's flag in its refusals).
_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "positive": _positive, "json_list": _json_list, "json_object": _json_object,
    "lora_module": _lora_module, "kv_events_config": _kv_events_config,
    "weight_transfer_config": _weight_transfer_config,
}
_ACTIONS: dict[str, Any] = {"boolean_optional": argparse.BooleanOptionalAction}
_ROW_KEYS = frozenset({"flags", "status", "scope", "ours", "reason", "supported", "spec", "example"})


def _row(data: dict[str, Any]) -> VllmOption:
    """One row of ``vllm_options.yaml``: its names of types, actions and values resolved; a key the table does not
    know is an error naming the row."""
    flag = data["flags"][0]
    unknown = sorted(set(data) - _ROW_KEYS)
    if unknown:
        raise ValueError(f"vllm_options.yaml {flag}: unknown key(s) {', '.join(unknown)}")
    spec = data.get("spec")
    if spec is not None:
        spec = dict(spec)
        if spec.get("default") == argparse.SUPPRESS:  # argparse knows its sentinel by identity, not by the string
            spec["default"] = argparse.SUPPRESS
        if "type" in spec:
            spec["type"] = _positive_float(flag) if spec["type"] == "positive_float" else _TYPES[spec["type"]]
        if "action" in spec:
            spec["action"] = _ACTIONS.get(spec["action"], spec["action"])
        if "choices" in spec:
            choices = spec["choices"]
            spec["choices"] = _NAMED_VALUES[choices] if isinstance(choices, str) else tuple(choices)
        if "supported" in data:  # vLLM's values this build implements; the others refused naming the flag and why
            values = _NAMED_VALUES[data["supported"]["values"]]
            spec["type"] = _supported(flag, values, data["supported"]["why"])
            spec.setdefault("metavar", "|".join(values))
    reason = data["reason"]
    for name, values in _NAMED_VALUES.items():
        reason = reason.replace(f"${name}", ", ".join(f"`{value}`" for value in values))
    return VllmOption(tuple(data["flags"]), Status(data["status"]), reason, ours=data.get("ours"),
                      spec=None if spec is None else MappingProxyType(spec),
                      scope=None if data.get("scope") is None else Scope(data["scope"]),
                      example=tuple(data.get("example", ())))


def _load(path: Path) -> tuple[VllmOption, ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it: the CLI reads this
    with open(path, encoding="utf-8") as file:
        return tuple(_row(data) for data in yaml.load(file, Loader=loader))


#: Every row, read from ``vllm_options.yaml`` beside this module (its order: the commands' own options, then those
#: defined here for the OpenAI server, then for the engines).
VLLM_OPTIONS: tuple[VllmOption, ...] = _load(Path(__file__).with_name("vllm_options.yaml"))


class _Refuse(argparse.Action):
    """A vLLM option that is not served here: the command stops with its usage and the reason."""

    def __init__(self, option_strings: list[str], dest: str, reason: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS,
                         help=f"refused: {reason}", **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {self.reason}")


def add_vllm_options(parser: argparse.ArgumentParser, scope: Scope) -> None:
    """Add the rows of ``scope`` that this table defines (implemented, accepted, refused) to ``parser``."""
    group = parser.add_argument_group(f"vLLM options ({scope.value})", "accepted under vLLM's names; see "
                                      "docs/vllm-mapping.md")
    for row in VLLM_OPTIONS:
        if row.scope is not scope:
            continue
        if row.status is Status.REFUSED:
            for flag in row.flags:
                try:
                    group.add_argument(flag, action=_Refuse, reason=row.reason, metavar="...")
                except argparse.ArgumentError:  # the command serves it (engine's multi-host data-parallel flags)
                    pass
            continue
        kwargs = dict(row.spec or {})
        if row.status is Status.ACCEPTED:
            kwargs.setdefault("default", argparse.SUPPRESS)  # present only when given: accepted_warnings reads that
            kwargs["help"] = f"accepted; changes nothing here: {row.reason}"
        group.add_argument(*row.flags, **kwargs)


def accepted_warnings(args: argparse.Namespace) -> list[str]:
    """One line per accepted-unchanged option given on the command line, saying why it changes nothing."""
    return [f"{row.name} is accepted for vLLM compatibility and changes nothing: {row.reason}"
            for row in VLLM_OPTIONS if row.status is Status.ACCEPTED and hasattr(args, row.dest)]
