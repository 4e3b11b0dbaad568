"""The pure pieces of LoRA adapters in a policy refit (weights.adapters) and of a peer pull (weights.peer_pull).

An engine builds every adapter before the first policy tensor reaches a live weight: the refit's routing
(:func:`~megatron_serve.engine.verbs.refit_targets.route`) hands them over before yielding any policy pair, and a refusal
there stops the stream with nothing yielded. A rendezvous
that lists adapters outside a sharded refit, or one twice, is refused. A peer pull copies a donor's state byte for
byte over a real gloo pair, and refuses a donor of another layout or epoch before any byte moves; a donor that is
gone fails the pull at once.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

from megatron_serve.model.loader import load_model
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.engine.verbs.refit_targets import route
from megatron_serve.weights.adapters import adapter_tensor, adapters_first, split_name
from megatron_serve.weights.peer_pull import REACH_S, PeerSource, PeerWeights, layout_digest
from megatron_serve.wire.messages import LoraPush, PeerShare, PieceSpec, Rendezvous, TensorSpec

from ..helpers import free_port

PUSH = LoraPush(name="math.v2", version=3, rank=4, alpha=8.0)


def test_adapter_names_split_back_even_with_dots():
    name = adapter_tensor("math.v2", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert split_name(name) == ("math.v2", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")


class _Held:
    """A refit target of the pure routing (:func:`route`): records when and what it was handed."""

    def __init__(self, prefix: str, before_policy: bool, seen: list, refuse: str | None = None):
        self.prefix, self.before_policy, self.seen, self.refuse = prefix, before_policy, seen, refuse

    def claims(self, name: str) -> bool:
        return name.startswith(self.prefix)

    def load(self, pairs) -> None:
        if self.refuse is not None:
            raise ValueError(self.refuse)
        self.seen.append((self.prefix, list(pairs)))


def test_adapters_are_built_before_the_first_policy_tensor():
    a_a, a_b = adapter_tensor("a", "x.lora_A.weight"), adapter_tensor("a", "x.lora_B.weight")
    stream = adapters_first([("model.norm.weight", 1), (a_a, 2), ("lm_head.weight", 3), (a_b, 4),
                             ("drafter.model.norm.weight", 5)])
    seen: list = []
    for pair in route(stream, [_Held("adapter/", True, seen), _Held("drafter.", False, seen)]):
        seen.append(pair[0])
    assert seen == [("adapter/", [(a_a, 2), (a_b, 4)]), "model.norm.weight", "lm_head.weight",
                    ("drafter.", [("drafter.model.norm.weight", 5)])]


def test_a_refused_adapter_stops_the_stream_before_any_policy_tensor():
    refusing = _Held("adapter/", True, [], refuse="LoRA adapter 'a': rank 16 above --max-lora-rank 8")
    stream = route([(adapter_tensor("a", "x.lora_A.weight"), 1), ("model.norm.weight", 2)], [refusing])
    with pytest.raises(ValueError, match="max-lora-rank"):
        next(stream)
    late = route([("model.norm.weight", 1), (adapter_tensor("a", "x.lora_A.weight"), 2)],
                 [_Held("adapter/", True, [])])
    with pytest.raises(ValueError, match="travel first"):
        list(late)


def _rendezvous(**fields) -> Rendezvous:
    spec = TensorSpec(name="model.norm.weight", shape=[4], dtype="float32")
    return Rendezvous(address="127.0.0.1:1", prefix="p" * 32, backend="gloo", bucket_bytes=1, manifest=[spec],
                      **fields)


def test_a_rendezvous_lists_adapters_only_in_a_sharded_refit_and_each_once():
    pieces = [PieceSpec("model.norm.weight", 0, (0,), (4,))]
    assert _rendezvous(pieces=pieces, adapters=[PUSH]).problem() is None
    assert "only in a sharded policy refit" in _rendezvous(adapters=[PUSH]).problem()
    assert "twice" in _rendezvous(pieces=pieces, adapters=[PUSH, PUSH]).problem()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer-pull-unit")
    return [load_model(str(make_tiny_model(root / name, seed=seed)), torch.float32, "cpu")
            for name, seed in (("a", 0), ("b", 1))]


def _pull(donor: torch.nn.Module, joiner: torch.nn.Module, served_epoch: int, wanted_epoch: int) -> dict | None:
    """The donor shares on a thread, the joiner pulls here (a real TCP store and gloo pair on loopback)."""
    peers = PeerWeights(donor, timeout=30.0)
    address, prefix = peers.address("127.0.0.1"), secrets.token_hex(16)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(
        sent=peers.share(PeerShare(engine_id="e2", prefix=prefix, epoch=wanted_epoch, timeout_s=10.0), served_epoch)))
    thread.start()
    try:
        list(PeerSource(address, prefix, wanted_epoch, 10.0, "rendezvous://t").tensors(joiner))
    finally:
        thread.join()
    return result["sent"]


def test_a_pull_copies_the_donors_state_byte_for_byte(models):
    donor, joiner = models
    assert layout_digest(donor) == layout_digest(joiner)
    before = {n: t.clone() for n, t in joiner.state_dict().items()}
    sent = _pull(donor, joiner, 1, 1)
    assert sent is not None and sent["bytes"] >= sum(t.numel() * t.element_size() for t in before.values())
    assert all(torch.equal(joiner.state_dict()[n], t) for n, t in donor.state_dict().items())
    assert not all(torch.equal(before[n], t) for n, t in donor.state_dict().items()), "control: they differed"


def test_a_donor_of_another_layout_or_epoch_is_refused_before_any_byte_moves(models, tmp_path):
    donor, _ = models
    joiner = load_model(str(make_tiny_model(tmp_path / "c", seed=2)), torch.bfloat16, "cpu")
    before = {n: t.clone() for n, t in joiner.state_dict().items()}
    with pytest.raises(ValueError, match="layout"):
        _pull(donor, joiner, 1, 1)
    same_layout = load_model(str(make_tiny_model(tmp_path / "d", seed=3)), torch.float32, "cpu")
    with pytest.raises(ValueError, match="serves epoch 1, not the fleet's 2"):
        _pull(donor, same_layout, 1, 2)
    assert all(torch.equal(joiner.state_dict()[n], t) for n, t in before.items())


def test_a_pull_from_a_donor_that_is_gone_fails_at_once(models):
    """The donor died between the coordinator's pairing and the pull (its store no longer listens): the joiner's pull
    fails within the reach time, not after the pull's whole timeout (120 s here) while requests wait on the joiner."""
    _, joiner = models
    gone = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"store at 127.0.0.1:{gone} did not answer .* its engine is gone"):
        list(PeerSource(f"127.0.0.1:{gone}", secrets.token_hex(16), 1, 120.0, "rendezvous://t").tensors(joiner))
    assert time.monotonic() - started < 3 * REACH_S
