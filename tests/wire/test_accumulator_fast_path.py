"""``DeltaAccumulator``'s path for a delta of ids alone, or of ids and their epochs, keeps what the full path
keeps: the same ids and their epochs (unreported, -1, where none came or they do not fit), nothing else; a
delta with anything more still takes the full path."""

from __future__ import annotations

from megatron_serve.wire.accumulator import DeltaAccumulator
from megatron_serve.wire.messages import TokenDelta, delta_past

SLOTS = DeltaAccumulator.__slots__


def _state(acc: DeltaAccumulator) -> dict:
    return {name: getattr(acc, name) for name in SLOTS}


def test_ids_alone_keep_what_the_full_path_keeps() -> None:
    fast, full = DeltaAccumulator([5]), DeltaAccumulator([5])
    for ids in ([1, 2], [3], []):
        fast.add(TokenDelta(new_tokens=ids), "r")
        # The full path, taken through its own code: an empty log-prob list is no log prob.
        full.add(TokenDelta(new_tokens=ids, new_log_probs=[]), "r")
    assert _state(fast) == _state(full)
    assert fast.tokens == [5, 1, 2, 3] and fast.policy_epochs == fast.kv_epochs == fast.lora_epochs == [-1] * 3


def test_a_delta_with_more_than_ids_keeps_it() -> None:
    acc = DeltaAccumulator()
    acc.add(TokenDelta(new_tokens=[1]), "r")
    acc.add(TokenDelta(new_tokens=[2, 3], new_log_probs=[-0.5, -0.25], epochs=[[4, 4], [2, 3]], cached_tokens=7), "r")
    assert acc.tokens == [1, 2, 3] and acc.log_probs == [-0.5, -0.25] and acc.cached_tokens == 7
    assert acc.policy_epochs == [-1, 4, 4] and acc.kv_epochs == [-1, 2, 3] and acc.lora_epochs == [-1, -1, -1]


def test_kept_ids_take_the_full_path_and_follow_the_kept_tokens() -> None:
    """return_top_p_token_ids: each token's kept ids are kept with it, only for the ``kept`` first (a stop string)."""
    acc = DeltaAccumulator()
    acc.add(TokenDelta(new_tokens=[1], top_p_token_ids=[[1, 4]]), "r")
    acc.tokens.append(2)
    acc.add_rest(TokenDelta(new_tokens=[2, 3], top_p_token_ids=[[2], [3, 5]]), 1, "r")
    assert acc.tokens == [1, 2] and acc.top_p_token_ids == [[1, 4], [2]]


def test_ids_with_epochs_keep_what_the_full_path_keeps() -> None:
    """What engines send every step (ids and their epochs) takes the fast path and keeps the same as the full one:
    two or three lists, lists of the wrong length as unreported, and only the ``kept`` first (a stop string)."""
    deltas = [([1], [[4], [2], [0]]), ([2, 3], [[4, 5], [2, 2]]), ([6], [[7], [8, 9]]), ([7, 8, 9], [[1, 2, 3]] * 3)]
    fast, full = DeltaAccumulator(), DeltaAccumulator()
    for (ids, epochs), kept in zip(deltas, (1, 2, 1, 2)):
        for acc, more in ((fast, {}), (full, {"new_log_probs": []})):  # an empty log-prob list: the full path
            acc.tokens.extend(ids[:kept])
            acc.add_rest(TokenDelta(new_tokens=ids, epochs=epochs, **more), kept, "r")
    assert _state(fast) == _state(full)
    assert fast.policy_epochs == [4, 4, 5, -1, 1, 2] and fast.kv_epochs == [2, 2, 2, -1, 1, 2]
    assert fast.lora_epochs == [0, -1, -1, -1, 1, 2]


def test_a_stop_token_delta_is_kept_and_a_catch_up_past_it_carries_it() -> None:
    """A delta that ends at the stop token takes the full path and leaves the flag (the coordinator's mirror hands it
    to a reconnected client's catch-up); a client that kept only part of it (a stop string first) does not keep it."""
    acc = DeltaAccumulator()
    acc.add(TokenDelta(new_tokens=[1, 2]), "r")
    assert not acc.stop_token
    acc.add(TokenDelta(new_tokens=[3, 9], epochs=[[0, 0], [0, 0], [-1, -1]], stop_token=True), "r")
    assert acc.stop_token and acc.tokens == [1, 2, 3, 9] and acc.policy_epochs == [-1, -1, 0, 0]
    cut = DeltaAccumulator()
    cut.tokens.append(3)
    cut.add_rest(TokenDelta(new_tokens=[3, 9], stop_token=True), 1, "r")
    assert not cut.stop_token
    catch_up = delta_past(TokenDelta(new_tokens=[3, 9], stop_token=True), 2, 3)
    assert catch_up is not None and catch_up.new_tokens == [9] and catch_up.stop_token
