"""TRL <= 1.10's weight protocol over a real fleet: a client process pushes a checkpoint parameter by parameter (gloo).

The fleet (``megatron-serve run`` of A, see :mod:`.weight_fleet`) runs; the client replays TRL 1.10's
``VLLMClient`` (``trl/generation/vllm_client.py``: ``init_communicator``, ``update_model_params``,
``close_communicator``) with gloo where TRL's broadcast is NCCL. Each parameter is one REFIT (TRL's protocol has no
commit point), so the epoch advances once per parameter. The tests run in file order.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from .weight_fleet import ADMIN, checkpoints, completions, epoch, fleet, run_trainer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.timeout(900)]


def calls(lines: list[dict]) -> list[tuple[str, int]]:
    return [(line["call"], line["status"]) for line in lines]


def test_a_bad_shape_is_refused_at_the_next_call_with_the_fleet_on_its_old_epoch_still_serving(fleet, checkpoints):
    lines = run_trainer(fleet, "trl", checkpoints.b, "--corrupt", "shape")
    count = len(load_file(f"{checkpoints.b}/model.safetensors"))
    assert epoch(fleet) == count - 1  # every parameter but the last loaded, one REFIT each
    closing = lines[-1]
    assert (closing["call"], closing["status"]) == ("/close_communicator/", 409)
    assert "(3, 3)" in closing["body"]["error"]["message"]
    # the mix it serves now (B's tensors, A's last one) back to A, from its directory (prime-rl's route)
    assert fleet.http.post("/update_weights", headers=ADMIN, json={"weight_dir": checkpoints.a}).status_code == 200
    assert completions(fleet) == (checkpoints.texts.a, {count})


def test_a_bad_dtype_is_refused_before_the_broadcast(fleet, checkpoints):
    served = epoch(fleet)
    lines = run_trainer(fleet, "trl", checkpoints.b, "--corrupt", "dtype")
    assert calls(lines)[-2:] == [("/update_named_param/", 400), ("/close_communicator/", 200)]
    assert "int8" in lines[-2]["body"]["error"]["message"]
    assert epoch(fleet) == served + len(lines) - 3  # each parameter before the refused one: one REFIT


def test_every_parameter_sent_serves_what_a_server_started_from_the_new_checkpoint_serves(fleet, checkpoints):
    served = epoch(fleet)
    lines = run_trainer(fleet, "trl", checkpoints.b)
    count = len(load_file(f"{checkpoints.b}/model.safetensors"))
    assert calls(lines) == [("/init_communicator/", 200), *[("/update_named_param/", 200)] * count,
                            ("/close_communicator/", 200)]
    assert completions(fleet) == (checkpoints.texts.b, {served + count})
