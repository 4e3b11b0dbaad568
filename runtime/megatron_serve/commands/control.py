"""``megatron-serve control VERB``: lifecycle verbs and status for humans and scripts.

Every verb's options come from the verb table (:mod:`megatron_serve.wire.verb_calls`): an option given to a verb
that does not take it, or a value the verb refuses, is refused by name before anything is sent.
Prints the acknowledged state (one line, plus per-engine facts) or, for ``status``, a table, and
then what the state means and which verb comes next (:func:`next_step`); ``--json`` prints the
coordinator's answer as one JSON object instead. Without ``--coordinator`` it talks to
``$MEGATRON_SERVE_COORDINATOR``, else to the user's ``megatron-serve run`` started in this directory
(:mod:`~megatron_serve.commands.local_runs`). The fleet secret comes from ``--token-file`` or
``$MEGATRON_SERVE_TOKEN``, else from the user's run at that address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from ..wire.lifecycle import FleetState, Verb, walk
from ..wire.verb_calls import CLI, VERB_CALLS, Arg, ArgumentError, VerbCall, verb_call
from . import local_runs
from .aliases import add_option
from .flags import add_flags
from .inputs import coordinator_address
from .options import COORDINATOR_ENV, add_coordinator_option, add_token_option, read_token

VERBS = (*(verb.value for verb in Verb), "status")


def _options() -> dict[str, list[tuple[VerbCall, Arg]]]:
    """Each option of the verbs' arguments (the verb table's, on the CLI) and the verbs that take it, in order."""
    options: dict[str, list[tuple[VerbCall, Arg]]] = {}
    for call in VERB_CALLS.values():
        for arg in call.on(CLI):
            options.setdefault(arg.name, []).append((call, arg))
    return options


def _help(takers: list[tuple[VerbCall, Arg]]) -> str:
    """An option's help: each verb's text for it (verbs with the same text share it), with the default."""
    texts: dict[str, list[str]] = {}
    for call, arg in takers:
        silent = arg.default in (None, False) or "default" in arg.help
        shown = arg.help if silent else f"{arg.help} (default {arg.default})"
        texts.setdefault(shown, []).append(call.verb.value)
    return "; ".join(f"{', '.join(verbs)}: {text}" for text, verbs in texts.items())


def _given(value: Any) -> bool:
    """Whether an option was given: not absent (None) nor an unset flag (False); a 0 was given (``0 in (None,
    False)`` holds, so ``--size 0`` and ``--epoch 0`` were taken for absent)."""
    return value is not None and value is not False


def _verb_name(given: str) -> str:
    """A verb as the command line may spell it: ``scale-ep`` is ``scale_ep``, as in the issue's words."""
    return given.replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("verb", choices=VERBS, type=_verb_name,
                        help="what to do: " + ", ".join(VERBS) + " (a hyphen for an underscore too: scale-ep)")
    add_coordinator_option(parser, required=False)
    add_flags(parser, "control_format")
    for name, takers in _options().items():
        arg = takers[0][1]
        text = _help(takers)
        if arg.kind is bool:
            parser.add_argument(arg.flag, dest=name, action="store_true", help=text)
        else:  # absent: None, so that an option given to a verb that does not take it is refused by name
            add_option(parser, arg.flag, dest=name, type=arg.kind, default=None,  # stop --shutdown-timeout too
                       choices=list(arg.choices) if arg.choices is not None else None, metavar=arg.metavar, help=text)
    add_flags(parser, "control_timeouts")
    add_token_option(parser, default="the secret of your `megatron-serve run` at that address, else none")


def verb_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments the command line gives ``args.verb``, checked by the verb table; ``ValueError`` names an
    option the verb does not take, or one it needs and did not get."""
    call = None if args.verb == "status" else verb_call(args.verb)
    taken = {arg.name: arg for arg in call.on(CLI)} if call is not None else {}
    for name, takers in _options().items():
        value = getattr(args, name)
        if name not in taken and _given(value):
            names = [taker.verb.value for taker, _ in takers]
            verbs = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
            raise ValueError(f"{takers[0][1].flag} applies to {verbs} only, not {args.verb}")
    for arg in taken.values():
        if arg.required and not getattr(args, arg.name):
            raise ValueError(f"{args.verb} needs {arg.flag} {arg.metavar} ({arg.help})")
    given = {name: getattr(args, name) for name in taken if _given(getattr(args, name))}
    if call is not None:
        try:
            call.bind(given)
        except ArgumentError as exc:
            flag = taken[exc.param].flag if exc.param in taken else exc.param
            raise ValueError(f"{args.verb} {flag}: {exc}") from None
    return given


async def _execute(args: argparse.Namespace, token: str | None, arguments: dict[str, Any]) -> dict[str, Any]:
    from ..client.coordinator_client import InferenceClient  # noqa: PLC0415

    client = InferenceClient(args.coordinator, token=token, role="control")
    try:
        await client.start(timeout=args.connect_timeout)
    except TimeoutError:
        raise RuntimeError(f"no coordinator answered at {args.coordinator} within {args.connect_timeout:.0f}s "
                           "(is it running? check --coordinator)") from None
    try:
        if args.verb == "status":
            return await client.status(timeout=args.timeout)
        return await client.control(args.verb, args.timeout, **arguments)
    finally:
        client.close()


def find_coordinator(args: argparse.Namespace) -> tuple[str, local_runs.LocalRun | None]:
    """The address to talk to, and the run it belongs to when it was found (the user's run started in this
    directory) rather than given."""
    if args.coordinator:
        return coordinator_address(args.coordinator), None
    if os.environ.get(COORDINATOR_ENV):
        return coordinator_address(os.environ[COORDINATOR_ENV], f"${COORDINATOR_ENV}"), None
    try:
        run = local_runs.find_local_run()
    except LookupError as exc:
        raise RuntimeError(str(exc)) from None
    return run.coordinator, run


def run(args: argparse.Namespace) -> int:
    from ..client.coordinator_client import ControlError, CoordinatorError  # noqa: PLC0415

    arguments = verb_arguments(args)
    args.coordinator, found = find_coordinator(args)
    token = read_token(args) or (found.secret() if found else local_runs.secret_for(args.coordinator))
    if found and not args.json:
        print(f"(the local `megatron-serve run`'s coordinator, {args.coordinator})")
    try:
        answer = asyncio.run(_execute(args, token, arguments))
    except ControlError as exc:
        raise RuntimeError(f"{args.verb} refused by the coordinator: {exc}") from None
    except CoordinatorError as exc:
        raise RuntimeError(f"coordinator error ({exc.code}): {exc}") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise RuntimeError(f"{args.verb}: no acknowledgement within {args.timeout:.0f}s") from None
    if args.json:
        print(json.dumps(answer, sort_keys=True, default=str))
        return 0
    print(format_status(answer) if args.verb == "status" else format_ack(args.verb, answer))
    print(next_step(answer["state"], "" if found else f" --coordinator {args.coordinator}"))
    return 0


# What each state means for a person at the terminal; the verbs back to serving come from the lifecycle table.
_STATE_MEANING = {
    FleetState.RUNNING: "serving requests",
    FleetState.PAUSED: "not stepping; requests wait, device memory kept",
    FleetState.SUSPENDED: "device memory released; requests wait",
    FleetState.STOPPED: "engines stopped; requests are refused",
}


def next_step(state: str, coordinator_flag: str = "") -> str:
    """One line: what ``state`` means and the command(s) that come next to serve again (the shortest
    walk to RUNNING over the lifecycle table's one-step edges, as the operator walks it)."""
    try:
        known = FleetState(state)
    except ValueError:
        return f"{state}: a state this client does not know"
    verbs = walk(known, FleetState.RUNNING)
    if not verbs:
        return f"{state}: {_STATE_MEANING[known]} (`megatron-serve control pause|suspend|stop` to change that)"
    commands = ", then ".join(f"`megatron-serve control {verb.value}{coordinator_flag}`" for verb in verbs)
    restart = " (once its engines have joined again)" if known is FleetState.STOPPED else ""
    return f"{state}: {_STATE_MEANING[known]}; next: {commands} to serve again{restart}"


def format_ack(verb: str, answer: dict[str, Any]) -> str:
    detail = answer.get("detail") or {}
    engines = detail.get("engines") or {}
    head = f"{verb}: fleet is {answer['state']}"
    if detail.get("noop"):
        head += " (already; no change)"
    head += f", acknowledged by {len(engines)} engine(s)"
    if "released_bytes" in detail:
        head += f", released {_bytes(detail['released_bytes'])}"
    if "mode" in detail:  # PAUSE: what its mode did
        head += f", mode {detail['mode']}"
        if "aborted" in detail:
            head += f": {detail['aborted']} request(s) aborted"
        if "waited_s" in detail:
            head += f": waited {detail['waited_s']:.1f}s, {detail.get('unfinished', 0)} request(s) paused unfinished"
    if "lora_name" in detail:
        head += f", LoRA adapter {detail['lora_name']!r} {'unloaded' if verb == 'unload_lora' else 'served'}"
    if verb == "refit" and "epoch" in detail:
        head += f", now serving epoch {detail['epoch']} from {detail.get('source')}"
    lines = [head]
    for engine_id, facts in sorted(engines.items()):
        shown = ", ".join(f"{k}={_bytes(v) if k == 'released_bytes' else v}" for k, v in sorted(facts.items()))
        lines.append(f"  {engine_id}: {shown}")
    return "\n".join(lines)


def format_status(status: dict[str, Any]) -> str:
    now = time.time()
    lines = [f"state: {status['state']}   queued: {status['queued']}   in flight: {status['in_flight']}   "
             f"completed: {status['completed']}   failed: {status['failed']}   aborted: {status.get('aborted', '-')}"]
    if status.get("epoch") is not None:  # weights generation (REFIT)
        lines[0] += f"   epoch: {status['epoch']}"
        if status.get("epoch_mismatch"):
            lines.append(f"engines on other weights: {', '.join(status['epoch_mismatch'])}")
        if status.get("incomplete_weights"):
            lines.append(f"engines holding incomplete weights (a refit failed midway; UNPAUSE refused until a "
                         f"refit completes): {', '.join(status['incomplete_weights'])}")
    for group in status.get("expert_groups") or []:  # SCALE_EP's size beside the ranks there
        ranks = group["ranks"]
        lines.append(f"expert-parallel group {group['group']}: {len(ranks)} of {group['wanted']} wanted ranks "
                     f"connected ({', '.join(map(str, ranks)) or 'none'}; --data-parallel-size {group['size']})")
    engines = status.get("engines") or []
    if not engines:
        lines.append("no engines connected")
        return "\n".join(lines)
    header = ("ENGINE", "GROUP", "STATE", "RUNNING", "WAITING", "KV FREE/TOTAL", "CACHED/COMPUTED", "LAYOUT",
              "WEIGHTS/RANK", "HEARTBEAT")
    rows = [header]
    for e in engines:
        age = now - float(e.get("last_heartbeat") or now)
        rows.append((str(e["id"]), str(e["group"]), str(e["state"]), str(e["running"]), str(e["waiting"]),
                     f"{e['kv_blocks_free']}/{e['kv_blocks_total']}",
                     f"{e.get('cached_tokens', '-')}/{e.get('computed_tokens', '-')}",  # prefix-cache token counters
                     _layout(e.get("info") or {}), _bytes((e.get("info") or {}).get("parameter_bytes", "-")),
                     f"{max(age, 0.0):.1f}s ago"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _layout(info: dict[str, Any]) -> str:
    """An engine group's parallel layout: ``tp2``, ``tp2 ep2`` (experts over the tensor-parallel ranks), ``tp2 pp3``,
    ``tp1 ep2 dp0/2`` (data-parallel attention rank 0 of 2, experts over all tp x dp ranks); ``prefill`` or ``decode``
    after it for an engine of a disaggregated fleet."""
    size, stages = info.get("tensor_parallel_size", 1), info.get("pipeline_parallel_size", 1)
    data = info.get("data_parallel_size", 1)
    role = {"kv_producer": " prefill", "kv_consumer": " decode"}.get(info.get("kv_role"), "")
    return (f"tp{size}" + (f" ep{size * data}" if info.get("expert_parallel") else "")
            + (f" pp{stages}" if stages > 1 else "")
            + (f" dp{info.get('data_parallel_rank')}/{data}" if data > 1 else "") + role)


def _bytes(value: Any) -> str:
    if not isinstance(value, int):
        return str(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)
