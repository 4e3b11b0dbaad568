"""The frameworks' group layouts and announcements, checked before any byte is received (no processes)."""

from __future__ import annotations

import pytest

from megatron_serve.weights.framework_groups import (TRL_PREFIX, Layout, TensorMeta, announced, packed_chunks,
                                                     sglang_prefixes)


def test_an_announcement_takes_vllms_and_trls_dtype_spellings_and_refuses_the_rest_by_name():
    metas = announced(["a", "b"], ["bfloat16", "torch.float32"], [[2, 3], []])
    assert metas == [TensorMeta("a", "bfloat16", (2, 3)), TensorMeta("b", "float32", ())]
    assert [m.nbytes for m in metas] == [12, 4]
    for names, dtypes, shapes, problem in [
            (["a"], ["int8"], [[1]], "dtype 'int8' cannot travel"),
            (["a", "b"], ["float32"], [[1], [1]], "one length"),
            (["a", "a"], ["float32"] * 2, [[1], [1]], "named twice"),
            (["a"], ["float32"], [[-1]], r"shape \[-1\] is not a list of sizes"),
            ([], [], [], "at least one")]:
        with pytest.raises(ValueError, match=problem):
            announced(names, dtypes, shapes)


def test_packing_cuts_a_buffer_once_it_holds_more_than_the_size_the_tensor_that_crossed_included():
    metas = [TensorMeta(name, "float32", (size,)) for name, size in [("a", 2), ("b", 2), ("c", 1), ("d", 8)]]
    assert [[m.name for m in chunk] for chunk in packed_chunks(metas, 10)] == [["a", "b"], ["c", "d"]]
    assert [[m.name for m in chunk] for chunk in packed_chunks(metas, 16)] == [["a", "b", "c"], ["d"]]
    assert [[m.name for m in chunk] for chunk in packed_chunks(metas, 52)] == [["a", "b", "c", "d"]]


def test_the_layouts_put_the_trainer_where_each_framework_does():
    vllm = Layout.trainer_first("10.0.0.1", 29500, 1, 3, "nccl")
    assert (vllm.ranks, vllm.src, vllm.prefixes, vllm.hosts_store) == ((1, 2), 0, (), False)
    sglang = Layout.trainer_first("10.0.0.1", 29500, 1, 2, "gloo", sglang_prefixes("g", "gloo"))
    assert sglang.prefixes == ("g", "g/", "cpu/")
    trl = Layout.trainer_last("0.0.0.0", 51216, 2, "gloo")
    assert (trl.ranks, trl.src, trl.prefixes, trl.hosts_store) == ((0,), 1, (TRL_PREFIX,), True)
    for bad, problem in [(dict(world_size=1), "world_size 1"), (dict(rank_offset=0), "distinct"),
                         (dict(backend="mpi"), "backend 'mpi'")]:
        arguments = {"host": "h", "port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo", **bad}
        with pytest.raises(ValueError, match=problem):
            Layout.trainer_first(**arguments)
