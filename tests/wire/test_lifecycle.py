"""The lifecycle table: complete, consistent with what engines do, and read by every component."""

from __future__ import annotations

import pytest

from megatron_serve.wire.lifecycle import (
    STEPS,
    TABLE,
    Deadline,
    FleetState,
    IllegalTransition,
    PauseMode,
    Step,
    Transition,
    Verb,
    engine_state_after,
    next_state,
    parse_pause_mode,
    transition,
    walk,
)

R, P, S, X = FleetState.RUNNING, FleetState.PAUSED, FleetState.SUSPENDED, FleetState.STOPPED


def test_every_verb_has_an_entry_in_every_state():
    assert set(TABLE) == set(FleetState)
    for state, row in TABLE.items():
        assert set(row) == set(Verb), state


@pytest.mark.parametrize("state", list(FleetState))
@pytest.mark.parametrize("verb", list(Verb))
def test_a_verb_leads_where_its_steps_lead_an_engine(state, verb):
    entry = TABLE[state][verb]
    if isinstance(entry, str):
        with pytest.raises(IllegalTransition):
            transition(state, verb)
        return
    engine = state
    for step in entry.steps:
        assert engine in STEPS[step].requires, (state, verb, step)
        engine = engine_state_after(step, engine)
    assert engine is entry.target, (state, verb)


def test_the_decisions_on_former_disagreements():
    # SUSPEND from RUNNING: legal, one verb of two steps (pauses first)
    assert transition(R, Verb.SUSPEND) == Transition(S, (Step.PAUSE, Step.SUSPEND))
    # RESUME where memory is resident: a no-op that keeps the state (never pauses a running fleet)
    assert transition(R, Verb.RESUME) == Transition(R, (Step.RESUME,))
    assert transition(P, Verb.RESUME) == Transition(P, (Step.RESUME,))
    assert transition(S, Verb.RESUME).target is P
    # PAUSE while SUSPENDED: nothing to do on the engines; UNPAUSE while SUSPENDED: RESUME first
    assert transition(S, Verb.PAUSE) == Transition(S, ())
    with pytest.raises(IllegalTransition, match="RESUME first"):
        transition(S, Verb.UNPAUSE)
    # STOPPED: only UNPAUSE restarts, STOP repeats
    assert {v for v, e in TABLE[X].items() if not isinstance(e, str)} == {Verb.UNPAUSE, Verb.STOP}
    with pytest.raises(IllegalTransition, match="PAUSE is not allowed while STOPPED"):
        transition(X, Verb.PAUSE)
    # REFIT: only PAUSED or SUSPENDED, keeps the state, verify before load
    for state in (P, S):
        assert transition(state, Verb.REFIT) == Transition(state, (Step.REFIT_VERIFY, Step.REFIT_LOAD))
    with pytest.raises(IllegalTransition, match="only allowed while PAUSED or SUSPENDED; the fleet is RUNNING"):
        transition(R, Verb.REFIT)
    # STOP from anywhere
    assert all(transition(state, Verb.STOP) == Transition(X, (Step.STOP,)) for state in FleetState)


def test_refit_steps_have_their_own_deadlines_and_phases():
    # the verify step reads a directory's tensors for the finite check (issue 55): the weights' deadline
    assert STEPS[Step.REFIT_VERIFY].deadline is Deadline.WEIGHTS and STEPS[Step.REFIT_VERIFY].phase == "verify"
    assert STEPS[Step.REFIT_LOAD].deadline is Deadline.WEIGHTS and STEPS[Step.REFIT_LOAD].phase == "load"
    assert {s for s, spec in STEPS.items() if spec.deadline is Deadline.WEIGHTS} == \
        {Step.SUSPEND, Step.RESUME, Step.REFIT_VERIFY, Step.REFIT_LOAD}
    assert STEPS[Step.STOP].deadline is Deadline.DRAIN
    assert STEPS[Step.REFIT_LOAD].requires == {P, S}


@pytest.mark.parametrize("current,target,verbs", [
    (R, R, []),
    (R, P, [Verb.PAUSE]),
    (R, S, [Verb.PAUSE, Verb.SUSPEND]),  # one-step edges only: the compound SUSPEND is not walked
    (S, R, [Verb.RESUME, Verb.UNPAUSE]),
    (X, S, [Verb.UNPAUSE, Verb.PAUSE, Verb.SUSPEND]),
    (P, X, [Verb.STOP]),
])
def test_walk_takes_one_acknowledged_step_per_verb(current, target, verbs):
    assert walk(current, target) == verbs
    state = current
    for verb in verbs:
        assert len(transition(state, verb).steps) == 1
        state = next_state(state, verb)
    assert state is target


def test_every_state_reaches_every_state():
    for a in FleetState:
        for b in FleetState:
            walk(a, b)


def test_names_parse_in_any_case_and_bad_names_are_named():
    assert next_state("running", "PAUSE") is P
    with pytest.raises(ValueError, match="unknown verb 'sleep'"):
        next_state("RUNNING", "sleep")
    with pytest.raises(ValueError, match="unknown lifecycle state 'NAPPING'"):
        walk("NAPPING", "RUNNING")


def test_pause_modes_parse_and_a_bad_one_names_the_field():
    assert parse_pause_mode(None) is PauseMode.KEEP  # a PAUSE without a mode (older peers)
    assert [parse_pause_mode(name) for name in ("keep", "WAIT", PauseMode.ABORT)] == list(PauseMode)
    with pytest.raises(ValueError, match=r"^spec.pauseMode must be one of keep, wait, abort; got 'halt'$"):
        parse_pause_mode("halt", field="spec.pauseMode")


def test_every_component_reads_the_table():
    import argparse

    from megatron_operator import lifecycle as operator_lifecycle
    from megatron_operator.crd import PAUSE_MODES
    from megatron_serve.commands.control import VERBS, add_arguments
    from megatron_serve.coordinator.verbs.table import HANDLERS
    from megatron_serve.server.admin import ADMIN_BODIES
    from megatron_serve.engine.verbs.actions import ACTIONS, REGISTER
    from megatron_serve.wire.protocol import HEADER_VERBS, VERB_HEADERS, step_of

    assert set(ACTIONS) - {REGISTER} == set(Step) - {Step.STOP}  # the engine knows what every step but STOP does
    assert set(HANDLERS) == set(Verb)  # the coordinator has a handler for every verb
    for step, spec in STEPS.items():  # and can tell every step from its message
        assert step_of(VERB_HEADERS[spec.verb], spec.phase) is step
    assert set(HEADER_VERBS.values()) == set(Verb)
    assert set(VERBS) == {v.value for v in Verb} | {"status"}
    assert operator_lifecycle.plan("RUNNING", "SUSPENDED") == ["pause", "suspend"]
    assert operator_lifecycle.STATES == tuple(s.value for s in FleetState)

    modes = [m.value for m in PauseMode]  # the pause modes are the same everywhere they are offered
    assert [m.lower() for m in PAUSE_MODES] == modes
    pause_body = next(body for body in ADMIN_BODIES if body.__name__ == "PauseRequest")
    assert list(pause_body.model_json_schema()["properties"]["mode"]["enum"]) == modes
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert next(a.choices for a in parser._actions if a.dest == "mode") == modes


@pytest.mark.parametrize("page", ["docs/kubernetes/lifecycle.md", "docs/architecture.md"])
def test_the_docs_show_the_table(page):
    from pathlib import Path

    from megatron_serve.wire.lifecycle import table_markdown

    text = (Path(__file__).resolve().parents[2] / page).read_text()
    assert table_markdown() in text, f"{page}'s lifecycle table is stale: paste lifecycle.table_markdown()"
