"""prime-rl's NCCL weight broadcast over a real fleet: ``/init_broadcaster``, then ``/update_weights {weight_dir}``
receives what the trainer broadcasts and commits it as one REFIT.

The fleet (``megatron-serve run`` of A, see :mod:`.weight_fleet`) runs; the trainer process replays prime-rl's
orchestrator (``src/prime_rl/orchestrator/client.py``: ``init_nccl_broadcast``, ``update_weights`` with its
``NCCL_READY`` marker) and its trainer's sender (``src/prime_rl/trainer/rl/broadcast/nccl.py``:
``broadcast_integer``, ``broadcast_state_dict`` layer by layer), gloo where prime-rl's communicator is NCCL. The
tests run in file order: refusals first (the fleet stays on A and epoch 0), then B's weights, then A's again
through the body of prime-rl's earlier orchestrators.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest
import torch
from safetensors.torch import load_file

from .weight_fleet import ADMIN, checkpoints, completions, epoch, fleet, run_trainer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.timeout(600)]


@pytest.mark.parametrize("corrupt, status, named", [("dtype", 400, "int8"),
                                                    ("name", 409, "model.layers.99.mlp.nope.weight"),
                                                    ("shape", 409, "(3, 3)")])
def test_a_bad_dtype_name_or_shape_is_refused_with_the_fleet_on_its_old_epoch_still_serving(
        fleet, checkpoints, corrupt, status, named):
    lines = run_trainer(fleet, "primerl-nccl", checkpoints.b, "--corrupt", corrupt)
    assert [(line["call"], line["status"]) for line in lines] == [("/init_broadcaster", 200),
                                                                  ("/update_weights", status)], lines
    assert named in lines[-1]["body"]["error"]["message"]
    assert epoch(fleet) == 0
    assert completions(fleet) == (checkpoints.texts.a, {0})


def test_a_broadcast_serves_what_a_server_started_from_the_new_checkpoint_serves(fleet, checkpoints):
    lines = run_trainer(fleet, "primerl-nccl", checkpoints.b)
    assert lines == [{"call": "/init_broadcaster", "status": 200, "body": {"status": "ok"}},
                     {"call": "/update_weights", "status": 200, "body": {"status": "ok"}}]
    assert completions(fleet) == (checkpoints.texts.b, {1})
    baseline = {name: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for name, t in load_file(f"{checkpoints.b}/model.safetensors").items()}
    checked = fleet.http.post("/weight_checker", json={"action": "compare", "baseline": baseline}, headers=ADMIN)
    assert checked.json() == {"match": True, "mismatches": []}  # every byte as the trainer held it


def test_the_earlier_orchestrators_body_joins_as_one_rank_of_its_server_count(fleet, checkpoints):
    lines = run_trainer(fleet, "primerl-nccl", checkpoints.a, "--legacy")
    assert [line["status"] for line in lines] == [200, 200], lines
    assert completions(fleet) == (checkpoints.texts.a, {2})


def test_a_broadcaster_body_is_refused_naming_what_is_wrong(fleet):
    body = {"host": "127.0.0.1", "port": 1, "rank_offset": 0, "inference_world_size": 1, "timeout": 5}
    assert fleet.http.post("/init_broadcaster", json=body).status_code == 401  # the admin key, as every weight route
    for changed, named in [({"session_id": "nixl"}, "session_id"),
                           ({"quantize_in_weight_transfer": True}, "quantize_in_weight_transfer"),
                           ({"rank_offset": 1}, "ranks [2]"),
                           ({"server_rank": 0}, "rank_offset")]:
        refused = fleet.http.post("/init_broadcaster", json={**body, **changed}, headers=ADMIN)
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], (changed, refused.text)


class _Runs:
    """A pickle that calls ``print`` when unpickled (any callable would do: this one harms nothing)."""

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return (print, ("a peer's pickle ran here",))


def test_the_metadata_reader_resolves_no_global_but_torch_size_and_dtypes(capsys):
    """A pickle from a peer names the callables it runs: only ``torch.Size`` and torch's dtypes are resolved."""
    from megatron_serve.server.rl.primerl_wire import metadata_of  # noqa: PLC0415 - torch, as the server's route

    sent = {torch.bfloat16: [("model.norm.weight", torch.Size([2, 3]), 6)], torch.float32: []}
    assert metadata_of(pickle.dumps(sent)) == [(torch.bfloat16, [("model.norm.weight", [2, 3], 6)]),
                                               (torch.float32, [])]
    for hostile in ({torch.float32: [("x", torch.Size([1]), 1)], "y": _Runs()}, [_Runs()], {torch.float32: _Runs()}):
        with pytest.raises(RuntimeError, match="builtins.print is not part of prime-rl's weight metadata"):
            metadata_of(pickle.dumps(hostile))
    assert capsys.readouterr().out == ""
    for malformed in ([], {torch.float32: [("x", [1])]}, {"float32": []}, {torch.float32: [("x", [1], -1)]}):
        with pytest.raises(RuntimeError, match="prime-rl's state dict metadata"):
            metadata_of(pickle.dumps(malformed))
