"""TRL 1.16's ``GRPOTrainer`` in server mode, constructed and stepped on a CPU against a ``megatron-serve run`` fleet.

Where CUDA is needed: ``VLLMClient.init_communicator`` (``trl/generation/vllm_client.py``, trl 1.16.0, the device
check before the weight-sync rendezvous) refuses a trainer whose device is not CUDA, and ``GRPOTrainer.__init__``
calls it (``VLLMGeneration._init_vllm``) in server mode: the first test shows construction stops exactly there,
after TRL's health, model and world-size calls went through. The second passes ``cuda`` (no index: TRL then sets no
device) to TRL's own ``init_communicator`` and replaces what vLLM's NCCL helpers do (``open_trainer_endpoint``,
``packed_nccl_broadcast_producer``, with ``get_ip`` and the "is vLLM installed" answer they come with) by gloo's
(:mod:`megatron_serve.client.trainer_group`), as ``weight_trainer.trl_client`` does; everything else is TRL's: two
training steps, each generating through ``/v1/completions`` (``logprobs: 0``), checking ``/server_info``'s
``logprobs_mode``, and syncing the weights through vLLM's weight routes before the next generation. TRL's session
carries the admin key (TRL sends none).
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import requests
import torch

from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights

from ..conftest import admin_run
from .weight_fleet import ADMIN, ADMIN_KEY

pytest.importorskip("trl", minversion="1.16")
vllm_client = pytest.importorskip("trl.generation.vllm_client")
vllm_generation = pytest.importorskip("trl.generation.vllm_generation")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("grpo-run")
    with admin_run(tiny_model, logs, ADMIN_KEY, "--weight-transfer-config", '{"backend": "gloo"}',
                   "--logprobs-mode", "processed_logprobs") as url:
        yield url


@pytest.fixture
def trl_over_gloo(monkeypatch):
    """TRL's client as it ships but for vLLM's NCCL helpers (gloo's in their place) and its session's admin key."""
    real_session = requests.Session

    def keyed() -> requests.Session:
        session = real_session()
        session.headers.update(ADMIN)
        return session

    def endpoint(init_info: dict) -> SimpleNamespace:
        group = trainer_init(init_info["master_address"], init_info["master_port"], init_info["world_size"],
                             timeout=120)
        return SimpleNamespace(pg=group, group=SimpleNamespace(store=None, socket=None))

    def broadcast(iterator, group, src, post_iter_func) -> None:  # noqa: ANN001 - vLLM's signature
        trainer_send_weights(((name, post_iter_func((name, t))) for name, t in iterator), group.pg, packed=True,
                             src=src)

    for module in (vllm_client, vllm_generation):
        monkeypatch.setattr(module, "is_vllm_available", lambda *_, **__: True)
    monkeypatch.setattr(vllm_client.requests, "Session", keyed)
    monkeypatch.setattr(vllm_client, "get_ip", lambda: "127.0.0.1", raising=False)
    monkeypatch.setattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True, raising=False)
    monkeypatch.setattr(vllm_client, "open_trainer_endpoint", endpoint, raising=False)
    monkeypatch.setattr(vllm_client, "packed_nccl_broadcast_producer", broadcast, raising=False)


def grpo(model: str, url: str, tmp_path) -> object:
    from datasets import Dataset  # noqa: PLC0415 - TRL's own needs, only here
    from trl import GRPOConfig, GRPOTrainer  # noqa: PLC0415

    prompts = Dataset.from_dict({"prompt": ["Hello there", "The quick brown fox", "1 2 3", "def f():"]})
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=2,
                      use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", bf16=False)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                       args=args, train_dataset=prompts)


def test_grpo_trainer_in_server_mode_needs_cuda_only_at_the_weight_sync_rendezvous(fleet, tiny_model, trl_over_gloo,
                                                                                   tmp_path):
    with pytest.raises(NotImplementedError, match="needs a CUDA device, got 'cpu'"):
        grpo(tiny_model, fleet, tmp_path)


def test_grpo_trainer_in_server_mode_steps_twice_on_a_cpu(fleet, tiny_model, trl_over_gloo, monkeypatch, tmp_path):
    original = vllm_client.VLLMClient.init_communicator
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator",
                        lambda self, device=0: original(self, device=torch.device("cuda")))
    epoch = httpx.get(f"{fleet}/v1/admin/status", headers=ADMIN).json()["epoch"]
    trainer = grpo(tiny_model, fleet, tmp_path)
    trainer.train()
    assert trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "sampling/sampling_logp_difference/max" in entry]
    assert len(logged) == 2
    # the server's log probs (processed, logprobs 0) are the trainer's own forward's, to float32 rounding
    assert all(entry["sampling/sampling_logp_difference/max"] < 1e-4 for entry in logged)
    assert httpx.get(f"{fleet}/v1/admin/status", headers=ADMIN).json()["epoch"] == epoch + 2  # a sync per step
    trainer.vllm_generation.vllm_client.close_communicator()
