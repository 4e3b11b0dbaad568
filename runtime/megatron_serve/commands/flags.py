"""Every command's own options as one table: each option declared once, as data.

The rows live in ``flags.yaml`` beside this module (its header says the keys), read once at import, in sections:
the options one command or one group of commands takes together (``coordinator``, ``engine``, ``http_server``,
``routing`` ...). A command's ``add_arguments`` adds its sections with :func:`add_flags`, in the order its
``--help`` lists them. vLLM's own options are the other table (:mod:`megatron_serve.client.vllm_options`), and
vLLM's names for ours are added beside them (:func:`.aliases.add_option`). Three kinds of options are generated
from the tables they belong to instead: ``control``'s per-verb options (``wire/verb_calls.py``), the request limits
(``limits.RequestLimits``) and the model's options, whose help each command words (``model_options.py``).

A row's values may name a constant (``{DEFAULT_PORT}``, ``{KNOWN_POLICIES}``, ``{FIRST_REQUEST_IDLE:g}`` in a help
text): the named values below, or those a caller passes, so that a default or a limit is written once, in the code
that uses it, and the help cannot go stale. ``tests/commands/test_flags.py`` holds the table's keys and names.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..http_options import FAIRNESS_HEADER, METRICS_COMPAT, Shedding
from ..limits import (DEFAULT_COORDINATOR_GRACE, DEFAULT_KEEP_ALIVE, DEFAULT_MAX_REQUEST_LOGPROBS, FIRST_REQUEST_IDLE,
                      HEALTH_STALL_TIMEOUT, READY_TIMEOUT, STATUS_INTERVAL, STATUS_TIMEOUT)
from ..multimodal import ImageOptions
from ..wire.lifecycle import KV_ON_REFIT
from ..wire.protocol import DEFAULT_PORT, MAX_MESSAGE_BYTES
from ..wire.sampling_params import LOGPROBS_MODES
from .aliases import add_option

#: The constants rows may name; a caller adds its own (``add_flags(parser, "http_server", default_host=...)``), and
#: those of modules that ``--help`` should not wait for (``KNOWN_POLICIES``: the coordinator package).
NAMED_VALUES: Mapping[str, Any] = {
    "FAIRNESS_HEADER": FAIRNESS_HEADER, "METRICS_COMPAT": METRICS_COMPAT,
    "SHEDDING": Shedding(), "IMAGES": ImageOptions, "DEFAULT_COORDINATOR_GRACE": DEFAULT_COORDINATOR_GRACE,
    "DEFAULT_KEEP_ALIVE": DEFAULT_KEEP_ALIVE, "DEFAULT_MAX_REQUEST_LOGPROBS": DEFAULT_MAX_REQUEST_LOGPROBS,
    "FIRST_REQUEST_IDLE": FIRST_REQUEST_IDLE, "HEALTH_STALL_TIMEOUT": HEALTH_STALL_TIMEOUT,
    "READY_TIMEOUT": READY_TIMEOUT, "STATUS_INTERVAL": STATUS_INTERVAL, "STATUS_TIMEOUT": STATUS_TIMEOUT,
    "KV_ON_REFIT": KV_ON_REFIT, "DEFAULT_PORT": DEFAULT_PORT, "MAX_MESSAGE_BYTES": MAX_MESSAGE_BYTES,
    "LOGPROBS_MODES": LOGPROBS_MODES,
}
#: A row's ``type`` by name, and its ``action`` where it is not argparse's own word (``store_true`` ...).
_TYPES: Mapping[str, type] = {"int": int, "float": float}
_ACTIONS: Mapping[str, Any] = {"boolean_optional": argparse.BooleanOptionalAction}
ROW_KEYS = frozenset({"flags", "action", "dest", "type", "default", "nargs", "choices", "metavar", "required", "help",
                      "exclusive"})
#: ``{NAME}``, ``{NAME.attribute}`` or ``{NAME:format}``; a JSON example's ``{"key": ...}`` is not one.
_NAME = re.compile(r"\{([A-Za-z_][\w.]*)(?::([^{}]*))?\}")


def _load(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The sections of ``flags.yaml``; a row without flags (but an include), or with a key the table does not know,
    is an error naming it."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it: every command reads this
    with open(path, encoding="utf-8") as file:
        sections: dict[str, list[dict[str, Any]]] = yaml.load(file, Loader=loader)
    for name, rows in sections.items():
        for row in rows:
            if "flags" not in row:
                if set(row) != {"include"}:
                    raise ValueError(f"flags.yaml {name}: row {row}: a row has flags, or is an include alone")
                continue
            unknown = sorted(set(row) - ROW_KEYS)
            if unknown:
                raise ValueError(f"flags.yaml {name}: row {row['flags']}: unknown key(s) {', '.join(unknown)}")
    return sections


SECTIONS: Mapping[str, list[dict[str, Any]]] = _load(Path(__file__).with_name("flags.yaml"))


def named(name: str, values: Mapping[str, Any]) -> Any:
    """The value ``name`` (``NAME`` or ``NAME.attribute``) stands for; ``KeyError`` names one that is not given."""
    head, *attributes = name.split(".")
    if head not in values:
        raise KeyError(f"flags.yaml names {{{name}}}, which is not given")
    value = values[head]
    for attribute in attributes:
        value = getattr(value, attribute)
    return value


def _resolve(value: Any, values: Mapping[str, Any]) -> Any:
    """A row's value with its names filled in: ``"{NAME}"`` alone is the named object itself (a default, a list of
    choices), a name inside a text is its formatted value."""
    if not isinstance(value, str):
        return value
    whole = _NAME.fullmatch(value)
    if whole is not None and whole.group(2) is None:
        return named(whole.group(1), values)
    return _NAME.sub(lambda match: format(named(match.group(1), values), match.group(2) or ""), value)


def add_flags(container: Any, *sections: str, **values: Any) -> None:
    """Add the rows of each of ``sections`` to ``container`` (a parser or an argument group), in the table's order,
    each with its vLLM names (:func:`.aliases.add_option`). ``values``: names the rows use besides
    :data:`NAMED_VALUES`. Rows sharing an ``exclusive`` word go in one mutually exclusive group."""
    given = {**NAMED_VALUES, **values}
    for section in sections:
        if section not in SECTIONS:
            raise KeyError(f"flags.yaml has no section {section!r} (it has: {', '.join(SECTIONS)})")
        exclusive: dict[str, Any] = {}
        for row in SECTIONS[section]:
            if "include" in row:
                add_flags(container, row["include"], **values)
                continue
            kwargs = {key: _resolve(value, given) for key, value in row.items() if key not in ("flags", "exclusive")}
            if "type" in kwargs:
                kwargs["type"] = _TYPES[kwargs["type"]]
            if "action" in kwargs:
                kwargs["action"] = _ACTIONS.get(kwargs["action"], kwargs["action"])
            target = container
            if "exclusive" in row:
                if row["exclusive"] not in exclusive:
                    exclusive[row["exclusive"]] = container.add_mutually_exclusive_group()
                target = exclusive[row["exclusive"]]
            add_option(target, *row["flags"], **kwargs)
