"""The sharded refit's plan without processes: cover checks, each engine rank's regions, chunks and buckets,
and loading from received regions equals loading the full tensors (bitwise)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_serve import Shard
from megatron_serve.model.config import ModelConfig
from megatron_serve.model.loader import build_model, load_weights
from megatron_serve.model.parallel import DataParallel, PipelineStage, TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.weights.layout import RegionSlice, engine_layout
from megatron_serve.weights.manifest import spec_of
from megatron_serve.weights.shards import (buckets_of, cover_problem, link_chunks, local_view, merge_manifests,
                                           piece_of, volume)
from megatron_serve.wire.messages import PieceSpec, TensorSpec

from .checkpoint_cuts import EXPERT, cut

SPEC = TensorSpec("w", (4, 6), "float32")


def test_cover_accepts_exact_covers_and_names_overlaps_gaps_and_strays():
    rows = [PieceSpec("w", 0, (0, 0), (2, 6)), PieceSpec("w", 1, (2, 0), (2, 6))]
    assert cover_problem([SPEC], rows) is None
    assert cover_problem([SPEC], [PieceSpec("w", 0, (0, 0), (4, 6))]) is None
    overlap = [PieceSpec("w", 0, (0, 0), (3, 6)), PieceSpec("w", 1, (2, 0), (2, 6))]
    assert cover_problem([SPEC], overlap) == "pieces of 'w' from trainer ranks 0 and 1 overlap at [2:3, 0:6]"
    gap = [PieceSpec("w", 0, (0, 0), (2, 6)), PieceSpec("w", 1, (3, 0), (1, 6))]
    assert "leave a gap: they cover 18 of its 24 elements" in cover_problem([SPEC], gap)
    outside = [PieceSpec("w", 0, (0, 0), (2, 6)), PieceSpec("w", 1, (2, 0), (3, 6))]
    assert "lies outside its full shape (4, 6)" in cover_problem([SPEC], outside)
    assert "the manifest has no such tensor" in cover_problem([SPEC], [*rows, PieceSpec("x", 0, (0,), (1,))])


def test_ranks_that_disagree_on_a_full_shape_are_refused():
    a = piece_of(("w", torch.zeros(2, 6), Shard((4, 6), (0, 0))), 0)
    b = piece_of(("w", torch.zeros(2, 6), Shard((5, 6), (2, 0))), 1)
    with pytest.raises(ValueError, match=r"trainer ranks disagree on 'w': full shape \(4, 6\)"):
        merge_manifests([[a[:2]], [b[:2]]])
    with pytest.raises(ValueError, match="offset .* has 1 dims"):
        Shard((4, 6), (0,))
    with pytest.raises(ValueError, match="must be a megatron_serve.Shard"):
        piece_of(("w", torch.zeros(2), (4,)), 0)


def test_chunks_are_the_intersections_cut_into_bounded_buckets():
    pieces = [PieceSpec("w", 0, (0, 0), (4, 3)), PieceSpec("w", 1, (0, 3), (4, 3))]  # cut by columns
    region = {"w": ((2, 0), (2, 6))}  # an engine rank serving rows 2..3
    chunks = link_chunks([SPEC], pieces, 1, region, bucket_bytes=1 << 20)
    assert [(c.piece, c.box) for c in chunks] == [(1, ((2, 3), (2, 3)))]
    small = link_chunks([SPEC], pieces, 0, {"w": ((0, 0), (4, 6))}, bucket_bytes=24)  # 2 rows of 3 floats
    assert [c.box for c in small] == [((0, 0), (2, 3)), ((2, 0), (2, 3))]
    buckets = buckets_of(small, 24)
    assert len(buckets) == 2 and all(b.nbytes <= 24 for b in buckets)
    local = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(local_view(local, (0, 0), small[1].box), local[2:4])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("shards") / "m", seed=3)
    return ModelConfig.from_dir(path), load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("rank", [0, 1])
def test_an_engine_rank_receives_only_its_slices_and_loads_them_bitwise(checkpoint, rank):
    config, state = checkpoint
    tp = TensorParallel(rank, 2)
    expected = build_model(config, torch.float32, "cpu", tp)
    load_weights(expected, state.items())
    manifest = [spec_of(name, tensor) for name, tensor in state.items()]
    regions = engine_layout(expected, manifest, holds_extra=rank == 0)
    served = sum(volume(box[1]) for box in regions.values())
    assert served < 0.6 * sum(t.numel() for t in state.values())  # about half: norms are replicated
    q = regions["model.layers.0.self_attn.q_proj.weight"]
    assert q == ((32 * rank, 0), (32, 64))  # column parallel: its rows
    assert regions["model.layers.0.self_attn.o_proj.weight"] == ((0, 32 * rank), (64, 32))  # row parallel
    assert regions["model.layers.0.input_layernorm.weight"] == ((0,), (64,))  # replicated
    # what its model has no place for (a drafter's tensors, an MTP layer's): whole on the group's rank 0 only
    extra = [TensorSpec("drafter.fc.weight", (4, 8), "float32"), TensorSpec("model.layers.9.mlp.up_proj.weight",
                                                                          (128, 64), "float32")]
    with_extra = engine_layout(expected, [*manifest, *extra], holds_extra=rank == 0)
    assert {n: with_extra.get(n) for n in ("drafter.fc.weight", "model.layers.9.mlp.up_proj.weight")} == (
        {"drafter.fc.weight": ((0, 0), (4, 8)), "model.layers.9.mlp.up_proj.weight": ((0, 0), (128, 64))}
        if rank == 0 else {"drafter.fc.weight": None, "model.layers.9.mlp.up_proj.weight": None})
    assert {n: b for n, b in with_extra.items() if n in regions} == regions

    # the pieces of a trainer of world size 2, received through the plan, give the same parameters
    specs, pieces, tensors = [], [], []
    for r in range(2):
        for name in state:
            for item in cut(name, state[name], r, 2):
                spec, piece, tensor = piece_of(item, r)
                specs.append(spec)
                pieces.append(piece)
                tensors.append(tensor)
    manifest, pieces = merge_manifests([list(zip(specs, pieces))])
    assert cover_problem(manifest, pieces) is None
    staged = {name: torch.empty(box[1]) for name, box in regions.items()}
    for sender in range(2):
        for chunk in link_chunks(manifest, pieces, sender, regions, bucket_bytes=4096):
            name = manifest[chunk.tensor].name
            local_view(staged[name], regions[name][0], chunk.box).copy_(
                local_view(tensors[chunk.piece], pieces[chunk.piece].offset, chunk.box))
    received = build_model(config, torch.float32, "cpu", tp)
    load_weights(received, ((n, RegionSlice(state[n].shape, regions[n][0], t)) for n, t in staged.items()))
    for (name, want), (_, got) in zip(expected.named_parameters(), received.named_parameters()):
        assert torch.equal(want, got), name
    with pytest.raises(ValueError, match="outside the region this rank received"):
        RegionSlice(state["model.embed_tokens.weight"].shape, (0, 0), torch.zeros(4, 64))[0:8]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("shards-moe") / "m", seed=3, arch="qwen3_moe")
    state = load_file(str(path / "model.safetensors"))
    return ModelConfig.from_dir(path), [spec_of(name, tensor) for name, tensor in state.items()]


DRAFTER = TensorSpec("drafter.fc.weight", (4, 8), "float32")


def _planned(config: ModelConfig, manifest: list[TensorSpec], tp: TensorParallel) -> dict:
    return engine_layout(build_model(config, torch.float32, "meta", tp), [*manifest, DRAFTER],
                         holds_extra=tp.engine_rank == 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_is_planned_only_its_own_experts(moe_checkpoint, rank):
    """Expert parallel over 2 ranks: rank 0 serves experts 0-3, rank 1 experts 4-7, each whole; attention stays
    tensor parallel; the drafter's tensor (no rank's model reads it) goes to rank 0 only."""
    config, manifest = moe_checkpoint
    regions = _planned(config, manifest, TensorParallel(rank, 2, expert_parallel=True))
    experts = {int(EXPERT.search(name)[1]) for name in regions if EXPERT.search(name)}
    assert experts == set(range(4 * rank, 4 * rank + 4))
    assert regions["model.layers.1.mlp.experts.5.up_proj.weight" if rank else
                   "model.layers.1.mlp.experts.2.up_proj.weight"] == ((0, 0), (64, 64))  # whole
    assert regions["model.layers.0.self_attn.q_proj.weight"] == ((32 * rank, 0), (32, 64))
    assert ("drafter.fc.weight" in regions) == (rank == 0)
    control = _planned(config, manifest, TensorParallel(rank, 2))  # tensor parallel: half of every expert
    assert {int(EXPERT.search(n)[1]) for n in control if EXPERT.search(n)} == set(range(8))


@pytest.mark.parametrize("dp_rank, rank", [(0, 1), (1, 0), (1, 1)])
def test_a_data_parallel_attention_rank_is_planned_its_quarter_of_the_experts(moe_checkpoint, dp_rank, rank):
    """Data-parallel attention 2 x tensor parallel 2: the experts are sharded over all four ranks (data-parallel
    rank 1's rank 0 holds the third quarter); each engine's rank 0 (its own, numbered from 0) keeps the extras."""
    config, manifest = moe_checkpoint
    tp = TensorParallel(rank, 2, expert_parallel=True, data_parallel=DataParallel(dp_rank, 2))
    regions = _planned(config, manifest, tp)
    first = 2 * (2 * dp_rank + rank)
    assert {int(EXPERT.search(n)[1]) for n in regions if EXPERT.search(n)} == {first, first + 1}
    assert tp.engine_rank == rank and ("drafter.fc.weight" in regions) == (rank == 0)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_stage_is_planned_only_its_own_layers(checkpoint, stage):
    """Two stages of one rank each: stage s serves layer s (and the embedding, final norm and LM head, which
    every stage holds); stage 1 is engine rank 1, so the drafter's tensor goes to stage 0 only."""
    config, state = checkpoint
    manifest = [spec_of(name, tensor) for name, tensor in state.items()]
    tp = TensorParallel(0, 1, stage=PipelineStage(stage, 2, stage, 1))
    regions = _planned(config, manifest, tp)
    layers = {int(name.split(".")[2]) for name in regions if name.startswith("model.layers.")}
    assert layers == {stage} and tp.engine_rank == stage
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(regions)
    assert all(box == ((0,) * len(box[0]), tuple(state[name].shape)) for name, box in regions.items()
               if name in state)  # whole
    assert ("drafter.fc.weight" in regions) == (stage == 0)


def _assemble(items: list) -> dict[str, torch.Tensor]:
    """Full tensors put together from pieces, after the cover check (as an engine serving everything would)."""
    pairs = [piece_of(item, 0)[:2] for item in items]
    manifest, pieces = merge_manifests([pairs])
    assert cover_problem(manifest, pieces) is None
    full = {spec.name: torch.empty(spec.shape) for spec in manifest}
    for item, piece in zip(items, pieces):
        local_view(full[piece.name], (0,) * len(piece.shape), (piece.offset, piece.shape)).copy_(item[1])
    return full


def test_megatron_core_fused_qkv_and_gate_up_shards_cut_into_hugging_face_pieces():
    from megatron_serve.weights.megatron_core import fused_qkv_pieces, gate_up_pieces, tp_piece

    heads, kv_heads, head_dim, hidden, tp = 8, 4, 3, 5, 2
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(kv_heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden)
    per_group = heads // kv_heads
    # Megatron-core's linear_qkv: per query group, its query heads, then its key head, then its value head
    fused = torch.cat([torch.cat([q[g * per_group * head_dim:(g + 1) * per_group * head_dim],
                                  k[g * head_dim:(g + 1) * head_dim], v[g * head_dim:(g + 1) * head_dim]])
                       for g in range(kv_heads)])
    local_rows = fused.shape[0] // tp
    items = [item for rank in range(tp) for item in fused_qkv_pieces(
        "model.layers.0.self_attn.", fused[rank * local_rows:(rank + 1) * local_rows], num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, tp_rank=rank, tp_size=tp)]
    full = _assemble(items)
    assert torch.equal(full["model.layers.0.self_attn.q_proj.weight"], q)
    assert torch.equal(full["model.layers.0.self_attn.k_proj.weight"], k)
    assert torch.equal(full["model.layers.0.self_attn.v_proj.weight"], v)

    gate, up = torch.randn(8, hidden), torch.randn(8, hidden)
    fc1 = [torch.cat([gate[r * 4:(r + 1) * 4], up[r * 4:(r + 1) * 4]]) for r in range(tp)]  # [gate; up] per rank
    full = _assemble([item for r in range(tp) for item in gate_up_pieces("mlp.", fc1[r], tp_rank=r, tp_size=tp)])
    assert torch.equal(full["mlp.gate_proj.weight"], gate) and torch.equal(full["mlp.up_proj.weight"], up)
    down = torch.randn(hidden, 8)
    full = _assemble([tp_piece("mlp.down_proj.weight", down[:, r * 4:(r + 1) * 4], 1, r, tp) for r in range(tp)])
    assert torch.equal(full["mlp.down_proj.weight"], down)
    with pytest.raises(ValueError, match="query groups split evenly"):
        fused_qkv_pieces("x.", fused, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tp_rank=0, tp_size=8)


def test_a_sharded_sender_without_a_process_group_says_what_it_needs():
    """Issue 65: ``WeightSender(rank=, world_size>1)`` with no group died at ``send`` with torch's "Default process
    group has not been initialized"; it is refused at once, naming both ways to give it one."""
    import torch.distributed as dist  # noqa: PLC0415

    from megatron_serve import WeightSender  # noqa: PLC0415

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group first, or pass group="):
        WeightSender(None, rank=1, world_size=2)
    assert WeightSender(None, rank=0, world_size=1).world_size == 1  # one rank needs no group
