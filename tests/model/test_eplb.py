"""EPLB's planner, map and moves without a model: replicas go to the busiest experts, every rank gets its slots and a
share of the load near the mean, the map sends each (token, expert) pair to a replica of its own expert, and the
moves between two placements leave every rank holding what the new one says."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_serve.config import EplbConfig, InferenceConfig
from megatron_serve.model.experts.eplb import (LayerPlacement, balancedness, identity_plan, pack, plan_layer,
                                               rank_loads, replicate)
from megatron_serve.model.experts.moves import plan_moves

#: 16 experts over 4 ranks, two hot ones (a router biased toward experts 3 and 9), as the engine tests' routers.
SKEWED = [40.0 if e in (3, 9) else 4.0 for e in range(16)]


def test_replicas_go_to_the_experts_with_the_most_load_per_replica():
    assert replicate(SKEWED, 16) == [1] * 16
    counts = replicate(SKEWED, 20)
    assert sum(counts) == 20 and counts[3] == counts[9] == 3 and all(c == 1 for e, c in enumerate(counts)
                                                                     if e not in (3, 9))
    assert replicate([5.0, 5.0, 1.0], 4) == [2, 1, 1]  # equals: the lowest id first
    with pytest.raises(ValueError, match="3 physical experts cannot hold 4"):
        replicate([1.0] * 4, 3)


def test_pack_fills_every_pack_heaviest_first_and_keeps_one_label_apart():
    where = pack([9.0, 1.0, 1.0, 9.0, 5.0, 5.0], [0, 1, 2, 3, 4, 5], 3)
    assert sorted(where.count(p) for p in range(3)) == [2, 2, 2]
    loads = [sum(w for w, p in zip([9.0, 1.0, 1.0, 9.0, 5.0, 5.0], where) if p == pack_) for pack_ in range(3)]
    assert max(loads) == 10.0
    # two copies of expert 7 never share a pack while another pack has room
    where = pack([6.0, 6.0, 1.0, 1.0], [7, 7, 1, 2], 2)
    assert where[0] != where[1]
    with pytest.raises(ValueError, match="5 items do not split into 2"):
        pack([1.0] * 5, list(range(5)), 2)


def test_plan_balances_a_skewed_router_that_index_placement_leaves_lopsided():
    before = balancedness(rank_loads(SKEWED, list(range(16)), 4))
    assert before < 0.7
    for physical in (20, 24):  # (16: no copies, and one expert alone is 40 of the mean 34)
        plan = plan_layer(SKEWED, physical, 4)
        assert balancedness(rank_loads(SKEWED, plan, 4)) >= 0.9, physical
        assert sorted(set(plan)) == list(range(16)) and len(plan) == physical
        per_rank = physical // 4
        for rank in range(4):  # each rank's slots hold ascending ids, no expert twice
            slots = plan[rank * per_rank:(rank + 1) * per_rank]
            assert slots == sorted(slots) and len(set(slots)) == per_rank
        assert plan_layer(SKEWED, physical, 4) == plan  # the same on every rank
    with pytest.raises(ValueError, match="18 physical experts do not split over 4"):
        plan_layer(SKEWED, 18, 4)


def test_copies_the_ranks_cannot_divide_go_to_idle_experts():
    """Two experts of eight take all the load (a top-2 router biased toward them): four copies more make six busy
    copies over four ranks (two ranks carry two) unless two of the copies go to idle experts."""
    load = [0.0, 0.0, 0.0, 50.0, 0.0, 50.0, 0.0, 0.0]
    assert balancedness(rank_loads(load, list(range(8)), 4)) == 0.5
    assert balancedness(rank_loads(load, plan_layer(load, 12, 4), 4)) == 1.0
    assert replicate(load, 12).count(1) == 6  # the greedy replication alone: 3 + 3 busy copies


def test_hierarchical_plan_keeps_each_group_on_one_node():
    load = [float(random.Random(e).randint(1, 50)) for e in range(16)]
    plan = plan_layer(load, 24, 4, groups=4, nodes=2)  # 4 groups of 4 experts, 2 nodes of 2 ranks
    nodes = [set(plan[:12]), set(plan[12:])]
    assert not nodes[0] & nodes[1] and nodes[0] | nodes[1] == set(range(16))
    for node in nodes:
        groups = {e // 4 for e in node}
        assert all(set(range(g * 4, g * 4 + 4)) <= node for g in groups), node  # whole groups per node
    assert plan_layer(load, 24, 4, groups=3, nodes=2) == plan_layer(load, 24, 4)  # groups that do not split: global


def test_identity_plan_is_index_placement_plus_copies():
    assert identity_plan(16, 16, 4) == list(range(16))
    plan = identity_plan(8, 12, 4)
    assert [plan[r * 3:r * 3 + 2] for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(set(plan)) == list(range(8))


def test_the_map_sends_each_pair_to_a_replica_of_its_expert_in_turn_and_counts_it():
    plan = plan_layer(SKEWED, 24, 4)
    placement = LayerPlacement(plan, 16, torch.device("cpu"))
    ids = torch.tensor([[3, 9, 0, 1]] * 6)
    physical = placement.physical(ids)
    assert [[plan[p] for p in row] for row in physical.tolist()] == ids.tolist()
    copies = {p for p, e in enumerate(plan) if e == 3}
    used = [p for row in physical.tolist() for p in row if plan[p] == 3]
    assert set(used) == copies and len(copies) > 1
    assert max(used.count(p) for p in copies) - min(used.count(p) for p in copies) <= 1  # spread evenly
    assert torch.equal(placement.physical(ids), physical)  # a pair's choice depends on its place and the step only
    one = torch.tensor([[3, 9, 0, 1]])
    turns = set()
    for _ in range(len(copies)):  # one token, step after step: the rotation visits every copy
        turns.add(int(placement.physical(one)[0, 0]))
        placement.rotation.add_(1)
    assert turns == copies
    assert int(placement.load.sum()) == 2 * ids.numel() + len(copies) * 4
    assert placement.logical_load(placement.load.clone()).tolist()[3] == 12 + len(copies)
    before = placement.replicas.data_ptr()
    placement.update(list(range(16)) + [3, 9] * 4)
    assert placement.replicas.data_ptr() == before  # in place: a captured graph keeps reading it
    with pytest.raises(ValueError, match="each of 16 logical experts"):
        placement.update([0] * 24)


@pytest.mark.parametrize("old_per, new_per", [(4, 5), (5, 5), (2, 3)])
def test_moves_leave_every_rank_holding_its_new_experts(old_per, new_per):
    """Every rank's moves simulated on lists: its sends arrive where the receiver's receives say, and each new slot
    ends up with the expert the new placement names."""
    ranks, rng = 4, random.Random(old_per * 10 + new_per)
    experts = old_per * ranks if old_per == 4 else 16 if old_per == 5 else 8
    old = plan_layer([float(rng.randint(1, 9)) for _ in range(experts)], old_per * ranks, ranks)
    new = plan_layer([float(rng.randint(1, 9)) for _ in range(experts)], new_per * ranks, ranks)
    moves = [plan_moves(old, new, ranks, rank) for rank in range(ranks)]
    for rank, mine in enumerate(moves):
        held = old[rank * old_per:(rank + 1) * old_per]
        result: list[int | None] = [None] * new_per
        for old_slot, new_slot in mine.local:
            result[new_slot] = held[old_slot]
        for source in range(ranks):
            sent = [old[source * old_per + slot] for slot in moves[source].sends[rank]]
            assert len(sent) == len(mine.receives[source])
            for slot, expert in zip(mine.receives[source], sent):
                result[slot] = expert
        assert result == new[rank * new_per:(rank + 1) * new_per]
    assert all(not m.moved for m in (plan_moves(old, old, ranks, r) for r in range(ranks)))
def test_eplb_config_takes_vllms_fields_and_names_what_is_wrong():
    config = InferenceConfig(enable_expert_parallel=True, tensor_parallel_size=2, enable_eplb=True,
                             eplb_config={"window_size": 8, "step_interval": 4, "num_redundant_experts": 4})
    assert config.eplb_config == EplbConfig(8, 4, 4, False)
    assert InferenceConfig(**config.to_dict()).eplb_config == config.eplb_config
    assert InferenceConfig(enable_expert_parallel=True, enable_eplb=True).eplb_config == EplbConfig()
    with pytest.raises(ValueError, match="unknown field 'window'"):
        InferenceConfig(enable_expert_parallel=True, enable_eplb=True, eplb_config={"window": 3})
    with pytest.raises(ValueError, match="step_interval must be an integer >= 1, got 0"):
        EplbConfig(step_interval=0)
    with pytest.raises(ValueError, match="needs enable_expert_parallel"):
        InferenceConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="eplb_config needs enable_eplb"):
        InferenceConfig(eplb_config={"window_size": 2})
    # adapters on the experts follow their moves (tests/parallel/test_lora_eplb.py): nothing refuses them
    assert InferenceConfig(enable_expert_parallel=True, enable_eplb=True, enable_lora=True).enable_eplb


def test_the_flags_and_keywords_reach_the_config():
    import argparse  # noqa: PLC0415

    from megatron_serve.client.vllm_args import parse_llm_keywords  # noqa: PLC0415
    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args  # noqa: PLC0415
    from megatron_serve.fleet.argv import inference_config_to_argv  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = InferenceConfig(enable_expert_parallel=True, device="cpu", enable_eplb=True,
                             eplb_config={"num_redundant_experts": 4, "step_interval": 7})
    argv = inference_config_to_argv(config)  # as run starts its engines
    assert "--enable-eplb" in argv and "--eplb-config" in argv
    assert inference_config_from_args(parser.parse_args(argv)).eplb_config == config.eplb_config
    assert not inference_config_from_args(parser.parse_args([])).enable_eplb
    assert parse_llm_keywords({"enable_eplb": True, "eplb_config": {"window_size": 5}}).config == {
        "enable_eplb": True, "eplb_config": {"window_size": 5}}
    with pytest.raises(ValueError, match="eplb_config"):
        parse_llm_keywords({"eplb_config": "big"})

