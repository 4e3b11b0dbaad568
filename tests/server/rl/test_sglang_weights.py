"""SGLang's weight routes over a real fleet: slime's distributed update from a trainer process (gloo), and from disk.

The fleet (``megatron-serve run`` of A, see :mod:`.weight_fleet`) runs; the trainer replays slime's calls (named in
``weight_trainer.py``). The tests run in file order: refusals (the fleet stays on A, epoch 0), B's weights from the
trainer's group, A's again from disk.
"""

from __future__ import annotations

import pytest

from .weight_fleet import (ADMIN, answer, assert_refused, checkpoints, completions, epoch, fleet,  # noqa: F401
                           run_trainer)

pytestmark = [pytest.mark.timeout(900)]

UPDATE = "/update_weights_from_distributed"


@pytest.mark.parametrize("corrupt, status", [("dtype", 400), ("name", 409), ("shape", 409)])
def test_a_bad_dtype_name_or_shape_is_refused_with_the_fleet_on_its_old_epoch_still_serving(
        fleet, checkpoints, corrupt, status):
    lines = run_trainer(fleet, "sglang", checkpoints.b, "--corrupt", corrupt, "--version", "3")
    assert_refused(lines, UPDATE, corrupt, status)
    assert answer(lines, "/destroy_weights_update_group")["status"] == 200
    assert epoch(fleet) == 0
    assert completions(fleet) == (checkpoints.texts.a, {0})


def test_a_distributed_update_serves_what_a_server_started_from_the_new_checkpoint_serves(fleet, checkpoints):
    before = fleet.http.post("/weights_checker", json={"action": "snapshot"}, headers=ADMIN)
    assert before.status_code == 409  # the weights the fleet started with never came through here

    lines = run_trainer(fleet, "sglang", checkpoints.b, "--version", "4")
    assert [(line["call"], line["status"], line["body"]["success"]) for line in lines] == [
        ("/init_weights_update_group", 200, True), (UPDATE, 200, True), ("/destroy_weights_update_group", 200, True)]
    assert completions(fleet) == (checkpoints.texts.b, {4})
    checker = [fleet.http.post("/weights_checker", json={"action": action}, headers=ADMIN).json()["success"]
               for action in ("snapshot", "compare")]
    assert checker == [True, True]


def test_an_update_from_disk_is_the_refit_of_the_directory_and_may_keep_the_fleet_paused(fleet, checkpoints):
    lines = run_trainer(fleet, "disk", checkpoints.a, "--version", "7")
    assert answer(lines, "/update_weights_from_disk") == {
        "call": "/update_weights_from_disk", "status": 200,
        "body": {"success": True, "message": "Succeeded to update model weights (epoch 7).", "num_paused_requests": 0}}
    assert completions(fleet) == (checkpoints.texts.a, {7})

    held = fleet.http.post("/update_weights_from_disk", headers=ADMIN, json={
        "model_path": checkpoints.b, "abort_all_requests": True, "keep_pause": True})
    assert held.status_code == 200, held.text
    status = fleet.http.get("/v1/admin/status", headers=ADMIN).json()
    assert (status["state"], status["epoch"]) == ("PAUSED", 8)
    assert fleet.http.post("/v1/admin/unpause", headers=ADMIN).status_code == 200
    assert completions(fleet) == (checkpoints.texts.b, {8})


def test_the_routes_refuse_what_they_cannot_do_by_name(fleet):
    post = fleet.http.post
    ipc = post("/update_weights_from_tensor", json={"serialized_named_tensors": []}, headers=ADMIN)
    assert ipc.status_code == 400 and "CUDA IPC" in ipc.text and "not on this fleet's machines" in ipc.text
    assert post(UPDATE, json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
                headers=ADMIN).status_code == 409  # no group
    reset = post("/weights_checker", json={"action": "reset_tensors"}, headers=ADMIN)
    assert reset.status_code == 400 and "REFIT" in reset.text
    wrong = post("/update_weights_from_disk", json={"model_path": "/no/such/model"}, headers=ADMIN)
    assert wrong.status_code == 409 and wrong.json()["error"]["code"] == "refit_failed"
    assert post("/update_weights_from_disk", json={"model_path": "/x"}).status_code == 401
