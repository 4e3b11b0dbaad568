"""prime-rl's weight routes over a real fleet: ``/update_weights {weight_dir}`` is the REFIT of the directory.

The fleet (``megatron-serve run`` of A, see :mod:`.weight_fleet`) runs; the orchestrator's call is replayed from
``prime_rl/orchestrator/client.py`` (``update_weights``), with no broadcaster joined (its NCCL broadcast:
``test_primerl_broadcast.py``). ``/update_weights`` is also vLLM's path: the body's keys say which.
"""

from __future__ import annotations

import pytest

from .weight_fleet import ADMIN, checkpoints, completions, epoch, fleet, run_trainer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.timeout(600)]


def test_a_checkpoint_directory_serves_what_a_server_started_from_it_serves(fleet, checkpoints):
    lines = run_trainer(fleet, "primerl", checkpoints.b)
    assert lines == [{"call": "/update_weights", "status": 200, "body": {"status": "ok"}}]
    assert completions(fleet) == (checkpoints.texts.b, {1})


def test_a_directory_the_engines_refuse_leaves_the_fleet_on_its_epoch_still_serving(fleet, checkpoints):
    refused = fleet.http.post("/update_weights", json={"weight_dir": "/no/such/model"}, headers=ADMIN)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "refit_failed"
    assert epoch(fleet) == 1
    assert completions(fleet) == (checkpoints.texts.b, {1})


def test_a_body_of_neither_form_is_refused_naming_both(fleet):
    for body in ({"weight_dir": "/x", "update_info": {}}, {"weights": "/x"}, {"weight_dir": None}):
        refused = fleet.http.post("/update_weights", json=body, headers=ADMIN)
        assert refused.status_code == 400, (body, refused.text)
    both = fleet.http.post("/update_weights", json={"weights": "/x"}, headers=ADMIN).text
    assert "update_info" in both and "weight_dir" in both
