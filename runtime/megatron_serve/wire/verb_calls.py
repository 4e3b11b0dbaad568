"""What each lifecycle verb takes from whoever asks for it: one table that every client surface reads.

:mod:`.lifecycle` says what a verb *does* (legal states, engine steps); this table says how it is
*called*: its arguments, their checks, and which surfaces offer it. The coordinator client's
``control(verb, **arguments)`` checks arguments against it and sends them as the verb's message
fields; the ``control`` command makes its options and its "applies to" refusals from it; the admin
API makes its ``POST /v1/admin/{verb}`` routes and their bodies from it; ``MegatronLLM`` and
``MegatronAsyncLLM`` call every verb through the same ``control``, and direct mode (no fleet) refuses
a fleet verb by this table. A new verb is a row here, its steps in :mod:`.lifecycle`, a header of its name in
:mod:`.protocol` (with fields of its own, its message in :mod:`.controls`), its handler in the coordinator's table
(``coordinator/verbs/table.py``) and what an engine does for it (``engine/verbs/actions.py``);
``tests/client/test_verb_table.py`` holds every surface to the table.

Pure, standard library only (the operator reads it too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .lifecycle import PauseMode, Verb, drain_timeout_problem, parse_pause_mode, parse_verb

#: The surfaces an argument is offered on: the Python API (and the wire), the ``control`` command, HTTP.
PYTHON, CLI, HTTP = "python", "cli", "http"
_EVERYWHERE = frozenset({PYTHON, CLI, HTTP})


class ArgumentError(ValueError):
    """An argument a verb refuses; ``param`` names it (the HTTP error's ``param``, the CLI's option)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Arg:
    """One argument of a verb: a Python keyword, a field of the verb's message, an HTTP body field, a CLI option."""

    name: str
    kind: type  # int, float, str, bool (another type: Python only)
    help: str
    default: Any = None
    required: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None  # numbers: at least this
    metavar: str | None = None  # the CLI's placeholder
    surfaces: frozenset[str] = _EVERYWHERE
    since: tuple[int, str] | None = None  # a value other than the default needs this protocol (and what it is called)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, verb: Verb, value: Any) -> None:
        """``ArgumentError`` naming the argument when ``value`` is not one it takes."""
        if value is None:
            if self.required:
                raise ArgumentError(f"{verb.value} needs {self.name}", self.name)
            return
        if self.kind not in _KIND_NAMES:
            return  # a Python object (a Rendezvous): its own type checks it
        if not _is_kind(value, self.kind):
            raise ArgumentError(f"{self.name} must be {_KIND_NAMES[self.kind]}, got {value!r}", self.name)
        if self.choices is not None and (value.lower() if isinstance(value, str) else value) not in self.choices:
            raise ArgumentError(f"{self.name} must be one of {', '.join(map(str, self.choices))}; got {value!r}",
                                self.name)
        if self.minimum is not None and value < self.minimum:
            raise ArgumentError(f"{self.name} must be >= {self.minimum:g}, got {value!r}", self.name)
        if self.kind is str and self.required and not value:
            raise ArgumentError(f"{self.name} must be a non-empty string, got {value!r}", self.name)


_KIND_NAMES = {int: "an integer", float: "a number of seconds", str: "a string", bool: "true or false"}


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool or kind is str:
        return isinstance(value, kind)
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return math.isfinite(value)


#: A verb's own rule over its arguments as given (after each one's check); returns the message's fields.
Fields = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class VerbCall:
    """How one verb is called (see the module docstring)."""

    verb: Verb
    summary: str  # one sentence: the CLI's help, the HTTP route's description, the docs
    args: tuple[Arg, ...] = ()
    method: str = ""  # the coordinator client's method of the same verb (default: the verb's name)
    http: bool = False  # offered as POST /v1/admin/{verb}
    direct: bool = False  # runs without a fleet (direct mode: one engine in the caller's process)
    fields: Fields | None = None

    @property
    def method_name(self) -> str:
        return self.method or self.verb.value

    def on(self, surface: str) -> tuple[Arg, ...]:
        return tuple(arg for arg in self.args if surface in arg.surfaces)

    def bind(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The message fields for ``arguments`` (keyword -> value; absent or None: the default), checked;
        ``ArgumentError`` names an argument this verb does not take or a value it refuses."""
        known = {arg.name: arg for arg in self.args}
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            takes = ", ".join(known) or "no arguments"
            raise ArgumentError(f"{self.verb.value} takes {takes}; not {', '.join(unknown)}", unknown[0])
        values = {name: arguments.get(name) for name in known}
        values = {name: arg.default if values[name] is None else values[name] for name, arg in known.items()}
        for name, arg in known.items():
            arg.check(self.verb, values[name])
        return self.fields(values) if self.fields is not None else values

    def too_new(self, fields: Mapping[str, Any], protocol: int) -> str | None:
        """Why a coordinator speaking ``protocol`` cannot run these message fields (it would ignore one), or None."""
        for arg in self.args:
            value = fields.get(arg.name)
            if arg.since is not None and protocol < arg.since[0] and value not in (None, arg.default):
                return (f"the coordinator speaks protocol {protocol}, which has no {arg.since[1]} (it would ignore "
                        f"{arg.name} {value!r}): upgrade the coordinator")
        return None


def _pause_fields(values: dict[str, Any]) -> dict[str, Any]:
    mode = parse_pause_mode(values["mode"])
    problem = drain_timeout_problem(mode, values["drain_timeout"])
    if problem is not None:
        raise ArgumentError(problem, "drain_timeout")
    # keep is a PAUSE without a mode: what coordinators older than pause modes understand
    return {"mode": None if mode is PauseMode.KEEP else mode.value, "drain_timeout": values["drain_timeout"]}


def _reset_fields(values: dict[str, Any]) -> dict[str, Any]:
    return {"reset_running_requests": values["reset_running_requests"] or None}


def _suspend_fields(values: dict[str, Any]) -> dict[str, Any]:
    return {"level": values["level"], "keep_kv": values["keep_kv"] or None}


_MODE = Arg("mode", str, "what happens to the requests the fleet holds: keep them in place (default), wait for the "
            "running ones to finish (queued ones wait), or abort them (finish_reason abort, tokens so far)",
            default=PauseMode.KEEP.value, choices=tuple(m.value for m in PauseMode), since=(3, "pause modes"))
_PAUSE_DRAIN = Arg("drain_timeout", float, "in mode wait, how long running requests may take before the fleet pauses "
                   "anyway (default 30)", minimum=0, metavar="S")
_LORA_NAME = Arg("lora_name", str, "the LoRA adapter's name (what requests give as their model)", required=True,
                 metavar="NAME")

#: The verbs, in the lifecycle table's order.
VERB_CALLS: dict[Verb, VerbCall] = {call.verb: call for call in (
    VerbCall(Verb.PAUSE, "PAUSE the fleet: engines stop stepping at a step boundary and keep their memory; requests "
             "wait for UNPAUSE", (_MODE, _PAUSE_DRAIN), http=True, fields=_pause_fields),
    VerbCall(Verb.UNPAUSE, "UNPAUSE: the fleet runs again (also restarts a stopped fleet once its engines joined "
             "again)", http=True),
    VerbCall(Verb.SUSPEND, "SUSPEND: release the KV cache (level 2: also the weights); pauses first when running", (
        Arg("level", int, "1 releases the KV cache; 2 also moves the weights to host memory", default=1,
            choices=(1, 2)),
        Arg("keep_kv", bool, "copy the KV of the requests in flight to host memory first; RESUME copies it back and "
            "they continue without recomputing it (docs/kv-tiers.md)", default=False),
    ), http=True, fields=_suspend_fields),
    VerbCall(Verb.RESUME, "RESUME: device memory is restored; the fleet is then PAUSED (unpause to run)", http=True),
    VerbCall(Verb.STOP, "STOP: every engine drains and exits", (
        Arg("drain_timeout", float, "how long engines may keep working before handing requests back", minimum=0,
            metavar="S"),
    )),
    VerbCall(Verb.REFIT, "REFIT from a model directory (the fleet must be PAUSED or SUSPENDED): every engine verifies "
             "the weights before any loads them", (
        Arg("source", str, "model directory, as the engines see it, with weights of the served model's shapes",
            required=True, metavar="DIR"),
        Arg("epoch", int, "generation recorded for the new weights (default: current + 1)", minimum=0, metavar="N"),
        Arg("rendezvous", object, "the weights come from a trainer (what WeightSender sends)", surfaces=frozenset({
            PYTHON})),
    ), http=True, direct=True),
    VerbCall(Verb.LOAD_LORA, "LOAD_LORA: every engine serves a PEFT adapter by name, once every engine checked it", (
        _LORA_NAME,
        Arg("lora_path", str, "the PEFT adapter's directory, as the engines see it", required=True, metavar="DIR"),
    ), method="load_lora_adapter", direct=True),
    VerbCall(Verb.UNLOAD_LORA, "UNLOAD_LORA: no engine serves the adapter to new requests; running ones finish under "
             "it", (_LORA_NAME,), method="unload_lora_adapter", direct=True),
    VerbCall(Verb.RESET_PREFIX_CACHE, "RESET_PREFIX_CACHE: every engine forgets every cached prefix block, in every "
             "KV tier; an engine whose running requests hold blocks does not, unless they are recomputed", (
        Arg("reset_running_requests", bool, "send the running requests back to be recomputed first, so that every "
            "engine resets (vLLM's reset_running_requests)", default=False),
    ), http=True, fields=_reset_fields),
    VerbCall(Verb.SCALE_EP, "SCALE_EP: an expert-parallel group of data-parallel attention ranks to N ranks: below "
             "its size the highest ranks hand their requests back and leave, the others regroup without them; above "
             "it the size is recorded and the missing ranks' engines join when started", (
        # not ``required``: direct mode refuses a fleet verb by name before its arguments (the coordinator needs it)
        Arg("size", int, "the data-parallel ranks the group is to have (at most its --data-parallel-size)",
            minimum=1, metavar="N"),
    )),
    VerbCall(Verb.STATUS_DETAIL, "STATUS_DETAIL: every engine says what it holds now (requests, KV blocks, weights, "
             "suspend level, adapters), where STATUS shows their last heartbeats; the fleet's state stays"),
)}


def verb_call(verb: Verb | str) -> VerbCall:
    """The row of ``verb`` (a name accepted in any case); ``ValueError`` naming the verbs otherwise."""
    return VERB_CALLS[parse_verb(verb)]
