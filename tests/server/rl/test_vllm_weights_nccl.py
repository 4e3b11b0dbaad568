"""vLLM's weight-transfer routes over NCCL, as TRL, SkyRL and prime-rl use them on GPUs: a machine with two GPUs.

The trainer broadcasts from a GPU of its own (``CUDA_VISIBLE_DEVICES``: NCCL refuses two ranks on one device), the
run's server joins the group on the other (``--weight-transfer-config '{"backend": "nccl"}'``) and hands what it
received to the fleet through the REFIT transaction. ``benchmarks/gpu_session.sh rl`` runs it; with fewer than two
GPUs it is skipped (the gloo legs of the same routes are ``test_vllm_weights.py``, on every machine).
"""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file

from ..conftest import admin_run
from .weight_fleet import ADMIN, ADMIN_KEY, checkpoints, completions, run_trainer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="a trainer and the server over NCCL need a GPU each (gpu_session.sh rl)")]

SERVER_GPU, TRAINER_GPU = "0", "1"


@pytest.fixture(scope="module")
def nccl_fleet(checkpoints, tmp_path_factory):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": SERVER_GPU}
    with admin_run(checkpoints.a, tmp_path_factory.mktemp("nccl-weights-run"), ADMIN_KEY,
                   "--weight-transfer-config", '{"backend": "nccl"}', env=env) as url, \
            httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        yield SimpleNamespace(url=url, http=http, model=model, path=checkpoints.a)


def checksums(model_dir: str) -> dict[str, str]:
    return {name: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in load_file(f"{model_dir}/model.safetensors").items()}


def test_a_packed_nccl_broadcast_from_another_gpu_loads_the_checkpoint_bitwise(nccl_fleet, checkpoints):
    before, _ = completions(nccl_fleet)
    lines = run_trainer(nccl_fleet, "vllm", checkpoints.b, "--version", "5", "--backend", "nccl",
                        env={"CUDA_VISIBLE_DEVICES": TRAINER_GPU})
    assert [(line["call"], line["status"]) for line in lines] == [
        ("/init_weight_transfer_engine", 200), ("/start_weight_update", 200), ("/update_weights", 200),
        ("/finish_weight_update", 200)], lines
    checked = nccl_fleet.http.post("/weight_checker", json={"action": "compare", "baseline": checksums(checkpoints.b)},
                                   headers=ADMIN)
    assert checked.json() == {"match": True, "mismatches": []}  # every byte, as the trainer held it
    after, epochs = completions(nccl_fleet)
    assert epochs == {5} and after != before

    lines = run_trainer(nccl_fleet, "vllm", checkpoints.a, "--version", "6", "--backend", "nccl", "--unpacked",
                        env={"CUDA_VISIBLE_DEVICES": TRAINER_GPU})
    assert lines[-1]["status"] == 200, lines
    assert completions(nccl_fleet) == (before, {6})  # back on A: its own texts again, under the new version
