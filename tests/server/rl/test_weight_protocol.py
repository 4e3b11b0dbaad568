"""The weight-update protocol every framework shares, over a real fleet: versions that increase, a trainer that
stalls (a real process, stopped with SIGSTOP) replaced within the bound, a second trainer answered at once, every
event in the server's log; prime-rl's weights-only step directories and AReaL's ``/areal_*`` routes.

The fleet is ``megatron-serve run`` of A (:mod:`.weight_fleet`); trainers are ``weight_trainer.py`` runs (the
stalled one a process of its own, so that it can be stopped). The tests run in file order and say which epoch they
leave.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from megatron_serve.server.rl.weight_slot import STALL_S

from ...helpers import free_port
from ...forked import start_script
from ..conftest import admin_run
from .weight_fleet import checkpoints  # noqa: F401 - a fixture
from .weight_fleet import ADMIN, ADMIN_KEY, TRAINER, Trainer, answer, completions, run_trainer

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fleet(checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp("weight-protocol-run")
    with admin_run(checkpoints.a, logs, ADMIN_KEY, "--weight-transfer-config", '{"backend": "gloo"}',
                   "--log-level", "INFO") as url, \
            httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        with Trainer() as trainer:
            yield SimpleNamespace(url=url, http=http, model=model, path=checkpoints.a, trainer=trainer, logs=logs)


def logged(fleet: SimpleNamespace) -> str:
    """Everything the fleet's processes logged so far."""
    return "\n".join(path.read_text(errors="replace") for path in sorted(fleet.logs.rglob("*"))
                     if path.is_file() and path.suffix in (".log", ".out"))


@contextmanager
def stalled_trainer(fleet: SimpleNamespace, model: str, port: int) -> Iterator[int]:
    """``weight_trainer.py stalled``, in a process of its own (forked from the worker's fork server, as the fleet's
    trainer), stopped (SIGSTOP) once the server receives from it; yields its pid, and kills it after."""
    with tempfile.NamedTemporaryFile("w+", prefix="stalled-trainer-", suffix=".err") as errors:
        stalled, stdin, stdout = start_script(TRAINER, ["stalled", fleet.url, model, str(port)],
                                              {"ADMIN_KEY": ADMIN_KEY}, errors.name)
        try:
            said = []
            for line in stdout:
                said.append(line)
                if line.startswith('{"stalled"'):
                    break
            else:
                pytest.fail(f"the stalled trainer ended first: {said} {errors.read()[-3000:]}")
            deadline = time.monotonic() + 60
            while "receiving" not in (probe := fleet.http.post("/start_weight_update", json={}, headers=ADMIN).text):
                assert time.monotonic() < deadline, f"the server never began receiving from the stalled one: {probe}"
                time.sleep(0.05)
            os.kill(stalled.pid, signal.SIGSTOP)
            yield stalled.pid
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
            stalled.kill()
            stalled.join()
            stdin.close()
            stdout.close()


def test_a_weight_version_must_increase_and_a_refused_one_leaves_the_fleet_serving(fleet, checkpoints):
    lines = run_trainer(fleet, "vllm", checkpoints.b, "--version", "5")
    assert answer(lines, "/finish_weight_update")["body"]["weight_version"] == "5"
    for version in ("5", "2"):  # repeated, lower: refused before anything moves, naming the version served
        refused = answer(run_trainer(fleet, "vllm", checkpoints.a, "--version", version), "/finish_weight_update")
        assert refused["status"] == 409, refused
        assert refused["body"]["error"]["code"] == "weight_version_not_increasing"
        assert f"weight version {version} is not above the version served, 5" in refused["body"]["error"]["message"]
    disk = fleet.http.post("/update_weights_from_disk", json={"model_path": checkpoints.a, "weight_version": "4"},
                           headers=ADMIN)
    assert disk.status_code == 409 and "served, 5" in disk.json()["error"]["message"]
    assert completions(fleet) == (checkpoints.texts.b, {5})
    assert "weight update refused: weight version 2 is not above the version served, 5" in logged(fleet)


def test_a_stalled_trainer_is_replaced_within_the_bound_and_a_second_trainer_answered_at_once(fleet, checkpoints):
    """Trainer S stops (SIGSTOP) after its ``/update_weights`` began: every call of another trainer is answered 409
    at once, naming S's update; once S made no progress for ``STALL_S`` seconds a new trainer's init ends it, and
    the new trainer's update completes (the fleet on its weights) within its own transfer's time."""
    port = free_port()
    with stalled_trainer(fleet, checkpoints.a, port):
        started = time.monotonic()
        busy = fleet.http.post("/start_weight_update", json={}, headers=ADMIN)
        assert busy.status_code == 409 and time.monotonic() - started < 5
        message = busy.json()["error"]["message"]
        assert f"the trainer group at 127.0.0.1:{port}" in message and "receiving" in message, message

        def still_for() -> float:
            refused = fleet.http.post("/start_weight_update", json={}, headers=ADMIN).json()["error"]["message"]
            found = re.search(r"last progress (\d+) s ago", refused)
            assert found, refused
            return float(found.group(1))

        while still_for() < STALL_S:  # what a replacement sees until then: 409, at once
            assert time.monotonic() - started < STALL_S + 30, "the stalled update never counted as stalled"
            time.sleep(1)
        replaced = time.monotonic()
        lines = run_trainer(fleet, "vllm", checkpoints.a, "--version", "8")
        assert [(line["call"], line["status"]) for line in lines] == [
            ("/init_weight_transfer_engine", 200), ("/start_weight_update", 200), ("/update_weights", 200),
            ("/finish_weight_update", 200)]
        assert time.monotonic() - replaced < 60
        assert completions(fleet) == (checkpoints.texts.a, {8})
    log = logged(fleet)
    assert "weight update stalled: receiving" in log and f"127.0.0.1:{port}" in log
    assert "weight transfer: joined the trainer group" in log and "weight update committed" in log


def test_abort_weight_update_ends_a_stalled_receive_at_once(fleet, checkpoints):
    with stalled_trainer(fleet, checkpoints.b, free_port()):
        assert fleet.http.post("/abort_weight_update", headers=ADMIN).json() == {"aborted": True}
        assert fleet.http.post("/abort_weight_update", headers=ADMIN).json() == {"aborted": False}
        lines = run_trainer(fleet, "vllm", checkpoints.b)
        assert [line["status"] for line in lines] == [200, 200, 200, 200]
        assert completions(fleet) == (checkpoints.texts.b, {9})
    assert "weight update aborted (POST /abort_weight_update)" in logged(fleet)


def test_a_prime_rl_step_directory_of_weights_only_refits_with_the_serving_models_config(fleet, checkpoints,
                                                                                        tmp_path):
    """prime-rl's trainer writes each step as shards, their index and ``STABLE``, no ``config.json``
    (``prime_rl/trainer/rl/broadcast/filesystem.py``)."""
    step = tmp_path / "step_3"
    step.mkdir()
    shard = "model-00001-of-00001.safetensors"
    shutil.copy(Path(checkpoints.a) / "model.safetensors", step / shard)
    header = (step / shard).read_bytes()
    names = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])
    (step / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: shard for name in names if name != "__metadata__"}}))
    (step / "STABLE").touch()
    assert not (step / "config.json").exists()
    lines = run_trainer(fleet, "primerl", str(step))
    assert lines == [{"call": "/update_weights", "status": 200, "body": {"status": "ok"}}]
    assert completions(fleet) == (checkpoints.texts.a, {10})


def test_areals_vllm_backend_updates_through_its_own_routes(fleet, checkpoints):
    lines = run_trainer(fleet, "areal", checkpoints.b)
    assert [(line["call"], line["status"]) for line in lines] == [
        ("/areal_pause_generation", 200), ("/areal_init_weights_update_group", 200),
        ("/areal_set_update_weight_meta", 200), ("/areal_update_weights_xccl", 200),
        ("/areal_continue_generation", 200)]
    assert answer(lines, "/areal_update_weights_xccl")["body"] == {"success": True, "message": "TP rank: 0 success\n"}
    assert completions(fleet) == (checkpoints.texts.b, {11})
    lines = run_trainer(fleet, "areal", checkpoints.a, "--disk")
    assert [line["status"] for line in lines] == [200, 200, 200]
    assert completions(fleet) == (checkpoints.texts.a, {12})
    lora = fleet.http.post("/areal_update_weights_lora_xccl", json={}, headers=ADMIN)
    assert lora.status_code == 400 and "/v1/load_lora_adapter" in lora.text
