"""LoRA adapters under tensor parallelism (gloo on CPU, two real rank processes): each rank holds its share of an
adapter (model.lora_shards) and a TP=2 engine gives what TP=1 gives, for a batch mixing adapters and the base, for
an adapter pushed from trainer memory, and in batch-invariant mode (the fixed-order reduction); the same for
adapters on MoE experts (split like the experts' intermediate dimension) mixed with dense adapters and the base."""

from __future__ import annotations

import pytest
import torch

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.client.lora_push import adapter_push
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.lora import slots as lora_slots
from megatron_serve.model.loader import load_model
from megatron_serve.model.lora.checkpoint import LoraAdapterError, read_adapter
from megatron_serve.model.lora.slots import LoraSlots
from megatron_serve.model.parallel import TensorParallel
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.rendezvous import LoraPush

from ..engine.test_lora_engine import _broken_copy
from ..lora_adapters import make_peft_adapter, peft_model
from ..prompts import PROMPTS, run_requests

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    # 4 query heads over 2 KV heads: TP=2 splits q, k and v (column-parallel B) and o_proj's inputs (row-parallel A)
    return str(make_tiny_model(tmp_path_factory.mktemp("lora-tp"), seed=3, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-tp-adapters")
    return {"r8": str(make_peft_adapter(base, root / "r8", rank=8, seed=8)),
            "r4": str(make_peft_adapter(base, root / "r4", rank=4, seed=4, targets=["q_proj", "v_proj", "down_proj"]))}


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True, return_log_probs=True,
                          lora_name=name)


JOBS = [(PROMPTS[0], "r8"), (PROMPTS[1], None), (PROMPTS[2], "r4"), (PROMPTS[3], "r8"), (PROMPTS[0], None)]


def _engine(base: str, adapters: dict[str, str], tp: int, **overrides) -> DynamicInferenceEngine:
    config = InferenceConfig(dtype="float32", block_size_tokens=8, device="cpu", enable_lora=True, max_loras=3,
                             max_lora_rank=8, lora_modules=adapters, tensor_parallel_size=tp, **overrides)
    return DynamicInferenceEngine.from_model_dir(base, config)


def _run(base: str, adapters: dict[str, str], tp: int, pushed=None, jobs=JOBS, **overrides):
    """Tokens and log probs of ``jobs`` in one batch (and of the pushed adapter's, when ``pushed`` is given)."""
    engine = _engine(base, adapters, tp, **overrides)
    try:
        outs = run_requests(engine, [(p, _greedy(n)) for p, n in jobs])
        results = [(o.generated_tokens, o.generated_log_probs) for o in outs]
        if pushed is not None:
            named, push = pushed
            engine.loras.push(push, named, set())
            outs = run_requests(engine, [(p, _greedy(push.name)) for p in PROMPTS[:2]])
            results += [(o.generated_tokens, o.generated_log_probs) for o in outs]
        return results
    finally:
        engine.shutdown()


def _assert_close(tp2, tp1) -> None:
    for (tokens, log_probs), (tokens_1, log_probs_1) in zip(tp2, tp1, strict=True):
        assert tokens == tokens_1
        assert log_probs == pytest.approx(log_probs_1, abs=1e-4)


def trainer_push(base: str, adapter: str) -> tuple[list[tuple[str, torch.Tensor]], LoraPush]:
    """The trainer's next policy pushed from its memory: ``adapter`` with every ``B`` scaled by -1.5, a different
    adapter than the directory's."""
    trainer = peft_model(base, adapter)
    with torch.no_grad():
        for name, param in trainer.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.5)
    return adapter_push("policy", trainer, version=1, rank=None, alpha=None, use_rslora=False, target_modules=None)


@pytest.mark.slow
def test_tp2_with_adapters_and_a_push_equals_tp1(base, adapters):
    pushed = trainer_push(base, adapters["r8"])
    tp1 = _run(base, adapters, 1, pushed)
    tp2 = _run(base, adapters, 2, pushed)
    _assert_close(tp2, tp1)
    # control: the adapters change the tokens (same prompt, r8 vs the base), so the comparison covers their deltas
    assert tp1[0][0] != tp1[4][0]
    assert tp1[5][0] != tp1[4][0]


@pytest.mark.slow
def test_tp2_batch_invariant_equals_tp1(base, adapters):
    """Batch-invariant TP=2: the row-parallel deltas join the partial sums of the fixed-order reduction. (Rows
    bitwise equal to each alone, dense adapter rows among them: the batch-invariant expert test below.)"""
    _assert_close(_run(base, adapters, 2, batch_invariant=True), _run(base, adapters, 1, batch_invariant=True))


# MoE experts: qwen2_moe with layer 1 of 3 sparse (8 experts of intermediate size 64: 32 columns a rank) beside a
# shared expert (its partial sums join the experts' in the one reduction); layers 0 and 2 dense.
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE_ADAPTERS = {  # name: (rank, target_modules, target_parameters)
    "experts": (4, [], EXPERTS),
    "attention+down": (8, ["q_proj", "v_proj"], EXPERTS[1:]),
    "dense": (8, r".*layers\.[02]\.mlp\.(gate|up|down)_proj|.*self_attn\.(q|k|v|o)_proj", None),
}
MOE_JOBS = [(PROMPTS[0], "experts"), (PROMPTS[1], None), (PROMPTS[2], "dense"), (PROMPTS[3], "attention+down"),
            (PROMPTS[0], None), (PROMPTS[1], "experts")]


def assert_expert_rows_their_own(base: str, adapters: dict[str, str], **parallel) -> None:
    """At two ranks (``parallel``: how they split the experts) in ``--batch-invariant``, each of ``MOE_JOBS``'s
    rows in the mixed batch is bitwise what it is alone, and one rank's: ``==`` under expert parallelism (the
    row-parallel layers and their adapters' deltas compute as one rank, ``InferenceConfig.gathers_rows``), close
    under tensor parallelism alone (each TP size splits the reductions its own way)."""
    engine = _engine(base, adapters, 2, batch_invariant=True, **parallel)
    try:
        batched = [(o.generated_tokens, o.generated_log_probs)
                   for o in run_requests(engine, [(p, _greedy(n)) for p, n in MOE_JOBS])]
        alone = [(o.generated_tokens, o.generated_log_probs)
                 for p, n in MOE_JOBS for o in run_requests(engine, [(p, _greedy(n))])]
    finally:
        engine.shutdown()
    assert batched == alone
    one = _run(base, adapters, 1, jobs=MOE_JOBS, batch_invariant=True)
    if parallel.get("enable_expert_parallel"):
        assert batched == one
    else:
        _assert_close(batched, one)


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("lora-tp-moe"), seed=5, arch="qwen2_moe", num_layers=3,
                               decoder_sparse_step=2))


@pytest.fixture(scope="module")
def moe_adapters(moe_base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-tp-moe-adapters")
    return {name: str(make_peft_adapter(moe_base, root / name.replace("+", "-"), rank=rank, seed=rank + 20,
                                        targets=targets, parameters=parameters, b_scale=2.0))
            for name, (rank, targets, parameters) in MOE_ADAPTERS.items()}


@pytest.mark.slow
def test_tp2_with_expert_adapters_and_an_expert_push_equals_tp1(moe_base, moe_adapters):
    """A batch of expert-adapter, dense-adapter and base rows, then a trainer's push of an expert adapter (the RL
    path: rank 0 keeps it and sends each rank its share at the slot write)."""
    pushed = trainer_push(moe_base, moe_adapters["experts"])
    assert {key.rpartition(".lora_")[0] for key, _ in pushed[0]} == {
        "base_model.model.model.layers.1.mlp.experts.base_layer", "base_model.model.model.layers.1.mlp.experts"}
    tp1 = _run(moe_base, moe_adapters, 1, pushed, MOE_JOBS, max_cpu_loras=4)
    tp2 = _run(moe_base, moe_adapters, 2, pushed, MOE_JOBS, max_cpu_loras=4)
    _assert_close(tp2, tp1)
    # control: each adapter changes the tokens of its prompt, so the comparison covers the expert deltas
    assert tp1[0][0] != tp1[4][0] and tp1[5][0] != tp1[1][0] and tp1[6][0] != tp1[4][0]


@pytest.mark.slow
def test_tp2_batch_invariant_expert_rows_are_their_own_and_equal_tp1(moe_base, moe_adapters):
    """``--batch-invariant`` at TP=2: each row of the mixed batch is bitwise what it is alone (the experts'
    partial sums, adapter rows included, added in rank order on every rank); against TP=1 the tokens are equal
    and the log probs close (each TP size splits the reductions its own way)."""
    assert_expert_rows_their_own(moe_base, moe_adapters)


def _expert_outputs(base: str, adapter: str, tp: TensorParallel) -> torch.Tensor:
    """The sparse layer's routed-expert output (this rank's partial sum) for 6 rows, 4 of them on the adapter."""
    model = load_model(base, torch.float32, "cpu", tp)
    slots = LoraSlots(model, 2, 8)
    slots.write(1, read_adapter("experts", adapter, model.config, 8))
    indices = torch.tensor([1, -1, 1, 1, -1, 1])
    slots.rows.set(indices, indices.numpy())
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    block = model.model.layers[1].mlp
    return block.experts(x, *block.route(x))


def test_expert_shares_add_up_to_the_unsplit_experts(moe_base, moe_adapters, monkeypatch):
    """Two ranks' partial sums (loaded in this process, added by hand as the reduction would) are the TP=1 output
    for adapter rows too; control: a share cut as one block of the fused gate|up rows (as an unfused projection
    splits) gives other rows."""
    full = _expert_outputs(moe_base, moe_adapters["experts"], TensorParallel())

    def summed() -> torch.Tensor:
        return sum(_expert_outputs(moe_base, moe_adapters["experts"], TensorParallel(rank, 2)) for rank in range(2))

    split = summed()
    assert torch.allclose(split, full, atol=1e-5)

    def one_block(projection, a, b, experts):
        tp, local = experts.tp, experts.local
        if projection == "experts.gate_up_proj":
            return a, b[:, 2 * local * tp.rank : 2 * local * (tp.rank + 1)]
        return a[:, :, tp.rank * local : (tp.rank + 1) * local], b

    monkeypatch.setattr(lora_slots, "expert_share", one_block)
    wrong = summed()
    assert not torch.allclose(wrong, full, atol=1e-2)
    assert torch.equal(wrong[[1, 4]], split[[1, 4]])  # base rows: the fused kernel's, untouched by the adapter


@pytest.mark.slow
def test_tp2_refuses_an_expert_adapter_cut_for_one_rank(moe_base, moe_adapters, tmp_path):
    """Expert adapters are no longer refused at TP=2, but one whose tensors do not fit is, naming the tensor and
    the shapes (a trainer's push of its rank's shard: half of down_proj's lora_A columns, half of gate_up's lora_B
    rows); nothing changes, the engine serves the same tokens."""
    prefix = "base_model.model.model.layers.1.mlp.experts"
    down_a, gate_up_b = f"{prefix}.lora_A.weight", f"{prefix}.base_layer.lora_B.weight"
    half_a = _broken_copy(moe_adapters["experts"], tmp_path / "a",
                          lambda t: t.update({down_a: t[down_a][:, :32].contiguous()}))
    half_b = _broken_copy(moe_adapters["experts"], tmp_path / "b", lambda t: t.update({gate_up_b: t[gate_up_b][:64]}))
    engine = _engine(moe_base, {"experts": moe_adapters["experts"]}, 2)
    try:
        before, = run_requests(engine, [(PROMPTS[0], _greedy("experts"))])
        with pytest.raises(LoraAdapterError, match=r"'half-a': layers.1.experts.down_proj has lora_A \(32, 32\) "
                                                   r"and lora_B \(64, 32\); the base model needs \(32, 64\)"):
            engine.adapters.load("half-a", half_a)
        with pytest.raises(LoraAdapterError, match=r"'half-b': layers.1.experts.gate_up_proj has lora_A \(32, 64\) "
                                                   r"and lora_B \(64, 32\); the base model needs \(32, 64\) and "
                                                   r"\(128, 32\)"):
            engine.adapters.load("half-b", half_b)
        assert engine.loras.names() == {"experts": moe_adapters["experts"]}
        after, = run_requests(engine, [(PROMPTS[0], _greedy("experts"))])
    finally:
        engine.shutdown()
    assert after.generated_tokens == before.generated_tokens
