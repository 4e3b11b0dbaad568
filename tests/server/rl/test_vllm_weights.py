"""vLLM's weight-transfer routes over a real fleet: a trainer process pushes a checkpoint through them (gloo).

The fleet (``megatron-serve run`` of A, see :mod:`.weight_fleet`) runs; the trainer replays TRL 1.16's
``VLLMClient`` weight sync (``trl/generation/vllm_client.py``: ``init_communicator``, ``weight_update``,
``update_named_params``), with gloo where TRL's broadcast is NCCL. The tests run in file order: refusals first
(the fleet stays on A and epoch 0), then B's weights, then A's again through vLLM's older single-call protocol.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from .weight_fleet import (ADMIN, answer, assert_refused, checkpoints, completions, epoch, fleet,  # noqa: F401
                           run_trainer)

pytestmark = [pytest.mark.timeout(900)]


@pytest.mark.parametrize("corrupt, call, status", [("dtype", "/update_weights", 400),
                                                   ("name", "/finish_weight_update", 409),
                                                   ("shape", "/finish_weight_update", 409)])
def test_a_bad_dtype_name_or_shape_is_refused_with_the_fleet_on_its_old_epoch_still_serving(
        fleet, checkpoints, corrupt, call, status):
    lines = run_trainer(fleet, "vllm", checkpoints.b, "--corrupt", corrupt, "--version", "3")
    assert_refused(lines, call, corrupt, status)
    assert epoch(fleet) == 0
    assert completions(fleet) == (checkpoints.texts.a, {0})


def test_an_update_serves_what_a_server_started_from_the_new_checkpoint_serves_under_its_version(fleet, checkpoints):
    lines = run_trainer(fleet, "vllm", checkpoints.b, "--version", "5")
    assert [(line["call"], line["status"]) for line in lines] == [
        ("/init_weight_transfer_engine", 200), ("/start_weight_update", 200), ("/update_weights", 200),
        ("/finish_weight_update", 200)]
    assert answer(lines, "/finish_weight_update")["body"] == {"message": "Weight update finished",
                                                              "weight_version": "5"}
    assert completions(fleet) == (checkpoints.texts.b, {5})
    assert fleet.http.get("/weight_info", headers=ADMIN).json() == {"weight_version": "5"}
    assert fleet.http.get("/v1/admin/status", headers=ADMIN).json()["state"] == "RUNNING"

    baseline = {name: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for name, t in load_file(f"{checkpoints.b}/model.safetensors").items()}
    checked = fleet.http.post("/weight_checker", json={"action": "compare", "baseline": baseline}, headers=ADMIN)
    assert checked.json() == {"match": True, "mismatches": []}
    assert fleet.http.post("/weight_checker", json={"action": "checksum"}, headers=ADMIN).json() == {
        "checksums": baseline}


def test_the_single_call_protocol_unpacked_commits_at_update_weights_under_the_next_epoch(fleet, checkpoints):
    lines = run_trainer(fleet, "vllm", checkpoints.a, "--no-start", "--unpacked")
    assert answer(lines, "/update_weights") == {"call": "/update_weights", "status": 200,
                                                "body": {"message": "Weights updated"}}
    assert completions(fleet) == (checkpoints.texts.a, {6})


def test_the_routes_answer_with_vllm_names_and_refuse_what_they_cannot_do(fleet):
    post = fleet.http.post
    assert post("/finish_weight_update", json={}).status_code == 401  # the admin key, like every weight route
    neither = post("/update_weights", json={"names": ["x"]}, headers=ADMIN)
    assert neither.status_code == 400 and "update_info" in neither.text and "weight_dir" in neither.text
    assert post("/finish_weight_update", json={}, headers=ADMIN).json() == {  # nothing started: vLLM's 200
        "message": "Weight update finished", "weight_version": "6"}
    assert post("/update_weight_version", json={"new_version": "6"}, headers=ADMIN).json() == {
        "success": True, "new_version": "6"}
    moved = post("/update_weight_version", json={"new_version": "9"}, headers=ADMIN)
    assert moved.status_code == 409 and "finish_weight_update" in moved.text
    reset = post("/weight_checker", json={"action": "reset"}, headers=ADMIN)
    assert reset.status_code == 400 and "REFIT" in reset.text
    version = post("/finish_weight_update", json={"weight_version": "v2"}, headers=ADMIN)
    assert version.status_code == 400 and version.json()["error"]["code"] == "invalid_weight_version"


def test_skyrls_worker_methods_through_collective_rpc_commit_once_under_the_next_epoch(fleet, checkpoints):
    """SkyRL HEAD's fully-async sync (``weight_trainer.skyrl``): its worker methods, ``update_weights_nccl`` among
    them, on a fleet it paused in keep mode; one REFIT at ``skyrl_finish_weight_update``, the fleet paused until
    SkyRL's ``/resume``."""
    lines = run_trainer(fleet, "vllm", checkpoints.b, "--skyrl")
    assert [(line["call"], line["status"]) for line in lines][1:] == [
        ("/pause?mode=keep&clear_cache=false", 200), *[("/collective_rpc", 200)] * 6, ("/resume", 200)]
    assert all(line["body"] == {"results": [None]} for line in lines if line["call"] == "/collective_rpc")
    assert completions(fleet) == (checkpoints.texts.b, {7})
    for method in ("update_weights_rdt", "update_weights_ipc", "reload_weights"):
        refused = fleet.http.post("/collective_rpc", json={"method": method}, headers=ADMIN)
        assert refused.status_code == 400 and method in refused.json()["error"]["message"]
    wrong = fleet.http.post("/collective_rpc", json={"method": "skyrl_wake_for_weight_sync",
                                                     "kwargs": {"tags": ["gpu"]}}, headers=ADMIN)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "kwargs.tags"


def test_trls_own_vllm_client_pushes_a_checkpoint_through_the_routes(fleet, checkpoints):
    """TRL 1.16's ``VLLMClient`` itself (``init_communicator``, ``update_model_params``, ``close_communicator``),
    only vLLM's NCCL trainer endpoint replaced by gloo (``weight_trainer.py``'s ``trl_client`` says what)."""
    pytest.importorskip("trl", minversion="1.16")
    served = epoch(fleet)
    lines = run_trainer(fleet, "trl-client", checkpoints.a)
    assert [(line["call"], line["status"]) for line in lines] == [
        ("/init_weight_transfer_engine", 200), ("/start_weight_update", 200), ("/update_weights", 200),
        ("/finish_weight_update", 200)]
    assert completions(fleet) == (checkpoints.texts.a, {served + 1})
