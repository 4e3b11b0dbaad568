"""Trainer rank 0 reads each engine rank's refit figures after the REFIT was answered: a rank that never
publishes (it died after loading) is left out after a short grace, not after the transfer's whole time-out."""

from __future__ import annotations

import pickle

import torch.distributed as dist

from megatron_serve.client.weight_sender import DEFAULT_TIMEOUT_S
from megatron_serve.weights.shards import received_key
from megatron_serve.weights.sending import FIGURES_AFTER_ANSWER_S, receivers


def test_a_rank_whose_figures_never_come_is_left_out_and_the_others_kept():
    store = dist.HashStore()
    store.set(received_key(1), pickle.dumps({"bytes": 10}))
    store.set(received_key(3), pickle.dumps({"bytes": 30}))
    assert receivers(store, 1, 4, timeout=0.2) == {1: {"bytes": 10}, 3: {"bytes": 30}}  # rank 2 died


def test_the_grace_is_shorter_than_a_transfer():
    assert FIGURES_AFTER_ANSWER_S < DEFAULT_TIMEOUT_S
