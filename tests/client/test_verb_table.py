"""The verb table (``wire/verb_calls.py``) holds every surface that calls a lifecycle verb: the wire messages, the
coordinator client, ``MegatronLLM``/``MegatronAsyncLLM``, direct mode, the ``control`` command, the admin API and
the docs. A verb or an argument added to the table and missing from a surface (or the other way round) fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import msgspec
import pytest

from megatron_serve.api.async_llm import MegatronAsyncLLM
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.client.local_engine import LocalEngineClient
from megatron_serve.commands import control
from megatron_serve.errors import NoFleet
from megatron_serve.server import admin
from megatron_serve.server.admin import ADMIN_BODIES, add_admin_routes
from megatron_serve.wire.lifecycle import TABLE, Verb
from megatron_serve.wire.messages import FROM_COORDINATOR, TO_COORDINATOR
from megatron_serve.wire.protocol import HEADER_VERBS, VERB_HEADERS
from megatron_serve.wire.verb_calls import CLI, HTTP, PYTHON, VERB_CALLS, Arg, ArgumentError, verb_call

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _keywords(function) -> set[str]:
    return {name for name, p in inspect.signature(function).parameters.items()
            if name not in ("self", "timeout") and p.kind is not inspect.Parameter.VAR_KEYWORD}


def test_every_verb_of_the_lifecycle_has_one_row_and_one_message():
    assert list(VERB_CALLS) == list(Verb) == list(TABLE[next(iter(TABLE))])
    assert set(VERB_HEADERS) == set(Verb) and set(HEADER_VERBS.values()) == set(Verb)
    for verb, call in VERB_CALLS.items():
        message = TO_COORDINATOR[VERB_HEADERS[verb]]
        fields = {field.name for field in msgspec.structs.fields(message)}
        assert {arg.name for arg in call.on(PYTHON)} <= fields, f"{verb}: the table's arguments are not {message}'s"
        assert fields - {"control_id"} - {arg.name for arg in call.args} <= {"phase"}, f"{verb}: unlisted fields"
        assert VERB_HEADERS[verb] in FROM_COORDINATOR


def test_the_coordinator_client_offers_every_verb_with_the_tables_arguments():
    for call in VERB_CALLS.values():  # every verb is control(verb); a named method, where one is, takes the same
        method = getattr(InferenceClient, call.method_name, None)
        if method is not None:
            assert _keywords(method) == {arg.name for arg in call.on(PYTHON)}, call.verb


def test_the_python_apis_call_every_verb_through_control_and_name_no_other_argument():
    for cls in (MegatronAsyncLLM, MegatronLLM):
        assert "verb" in inspect.signature(cls.control).parameters
        for call in VERB_CALLS.values():
            method = getattr(cls, call.method_name, None)
            if method is not None and call.verb is not Verb.REFIT:  # refit takes weights: a directory or tensors
                assert _keywords(method) <= {arg.name for arg in call.on(PYTHON)}, (cls.__name__, call.verb)


async def test_direct_mode_runs_the_direct_verbs_and_refuses_the_others_by_the_table():
    local = LocalEngineClient.__new__(LocalEngineClient)  # no engine: nothing here may reach one
    for call in VERB_CALLS.values():
        if call.direct:
            assert callable(getattr(local, call.method_name)), call.verb
            continue
        with pytest.raises(NoFleet, match=rf"{call.verb.value}\(\) needs coordinator mode"):
            await local.control(call.verb)
    with pytest.raises(ValueError, match="mode must be one of keep, wait, abort; got 'later'"):
        await local.control("pause", mode="later")  # checked before the mode is looked at


def test_arguments_are_checked_by_name():
    with pytest.raises(ArgumentError, match="unpause takes no arguments; not level") as err:
        verb_call("unpause").bind({"level": 2})
    assert err.value.param == "level"
    with pytest.raises(ArgumentError, match="refit needs source"):
        verb_call(Verb.REFIT).bind({})
    with pytest.raises(ArgumentError, match="epoch must be >= 0, got -1"):
        verb_call("refit").bind({"source": "/w", "epoch": -1})
    with pytest.raises(ArgumentError, match="level must be one of 1, 2; got 3"):
        verb_call("suspend").bind({"level": 3})
    with pytest.raises(ArgumentError, match="keep_kv must be true or false"):
        verb_call("suspend").bind({"keep_kv": "yes"})
    with pytest.raises(ArgumentError, match="drain_timeout applies to mode wait only, not abort"):
        verb_call("pause").bind({"mode": "abort", "drain_timeout": 1.0})
    assert verb_call("PAUSE").bind({"mode": "WAIT", "drain_timeout": 2}) == {"mode": "wait", "drain_timeout": 2}
    assert verb_call("pause").bind({}) == {"mode": None, "drain_timeout": None}  # keep: no mode on the wire
    assert verb_call("suspend").bind({}) == {"level": 1, "keep_kv": None}


def test_an_older_coordinator_is_refused_only_what_it_lacks():
    pause = verb_call("pause")
    assert "protocol 2, which has no pause modes" in pause.too_new(pause.bind({"mode": "abort"}), 2)
    assert pause.too_new(pause.bind({}), 2) is None and pause.too_new(pause.bind({"mode": "abort"}), 3) is None


def test_the_control_command_has_one_option_per_argument_and_refuses_a_misplaced_one():
    parser = argparse.ArgumentParser()
    control.add_arguments(parser)
    verbs = next(action for action in parser._actions if action.dest == "verb")
    assert list(verbs.choices) == [verb.value for verb in Verb] + ["status"]
    options = {action.dest: action for action in parser._actions}
    for call in VERB_CALLS.values():
        for arg in call.on(CLI):
            assert arg.flag in options[arg.name].option_strings and call.verb.value in options[arg.name].help
    args = parser.parse_args(["suspend", "--level", "2", "--keep-kv"])
    assert control.verb_arguments(args) == {"level": 2, "keep_kv": True}
    with pytest.raises(ValueError, match="--keep-kv applies to suspend only, not resume"):
        control.verb_arguments(parser.parse_args(["resume", "--keep-kv"]))
    with pytest.raises(ValueError, match="--drain-timeout applies to pause and stop only, not unpause"):
        control.verb_arguments(parser.parse_args(["unpause", "--drain-timeout", "3"]))
    with pytest.raises(ValueError, match="refit needs --source DIR"):
        control.verb_arguments(parser.parse_args(["refit"]))
    with pytest.raises(ValueError, match="pause --drain-timeout: drain_timeout applies to mode wait only"):
        control.verb_arguments(parser.parse_args(["pause", "--drain-timeout", "3"]))


def test_the_admin_api_has_one_route_per_http_verb_whose_body_is_the_tables():
    from fastapi import FastAPI

    app = FastAPI()
    add_admin_routes(app, backend=None, monitor=None, admin_key="k")  # type: ignore[arg-type]
    posted = {route.path for route in app.routes if "POST" in getattr(route, "methods", ())}
    assert posted == {f"/v1/admin/{call.verb.value}" for call in VERB_CALLS.values() if call.http}
    bodies = {body.__name__: set(body.model_fields) for body in ADMIN_BODIES}
    for call in VERB_CALLS.values():
        if call.http:
            names = {arg.name for arg in call.on(HTTP)}
            assert names in bodies.values() and (not names or bodies[f"{call.verb.name.title()}Request"] == names)


def test_an_argument_added_to_the_table_reaches_the_command_line_the_http_body_and_the_client(monkeypatch):
    hint = Arg("warm_blocks", int, "KV blocks to warm first", minimum=0, metavar="N")
    monkeypatch.setitem(VERB_CALLS, Verb.RESUME, dataclasses.replace(VERB_CALLS[Verb.RESUME], args=(hint,)))
    parser = argparse.ArgumentParser()
    control.add_arguments(parser)
    assert control.verb_arguments(parser.parse_args(["resume", "--warm-blocks", "3"])) == {"warm_blocks": 3}
    with pytest.raises(ValueError, match="--warm-blocks applies to resume only, not pause"):
        control.verb_arguments(parser.parse_args(["pause", "--warm-blocks", "3"]))
    assert set(admin._body(VERB_CALLS[Verb.RESUME]).model_fields) == {"warm_blocks"}
    with pytest.raises(ArgumentError, match="warm_blocks must be >= 0"):
        verb_call("resume").bind({"warm_blocks": -1})


def test_the_docs_name_every_verb_and_the_generic_call():
    api = (DOCS / "python-api.md").read_text()
    cli = (DOCS / "reference" / "cli.md").read_text()
    assert "control(" in api
    for call in VERB_CALLS.values():
        assert call.verb.value in cli
        for arg in call.on(CLI):
            assert arg.flag in cli
