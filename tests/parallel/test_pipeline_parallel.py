"""Pipeline parallelism (``pipeline_parallel_size``) on CPU over gloo: each stage reads and holds only its layers
and its layers' KV cache; a dense model over 2 and 3 stages (4 layers: 2+2, and the uneven 2+1+1) gives the tokens
and log probs (``==``) of one stage in one micro-batch, its tokens in micro-batches (log probs ``==`` in the
batch-invariant mode), over 2 stages of 2 tensor-parallel ranks the tokens of one stage of 2; a refit from a directory
reaches every stage, a trainer's broadcast refit every rank of a pipeline-parallel group."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_serve import InferenceConfig, MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.engine import sizing
from megatron_serve.model.config import ModelConfig
from megatron_serve.model.errors import UnsupportedModelError
from megatron_serve.model.llama import PipelineGap
from megatron_serve.model.loader import build_model, iterate_checkpoint, load_weights
from megatron_serve.model.layout import stage_layers
from megatron_serve.model.parallel import PipelineStage, TensorParallel
from megatron_serve.model.tiny import make_tiny_model

from ..prompts import PROMPTS
from .test_expert_parallel import Recording

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, return_log_probs=True,
                        top_n_logprobs=2)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("pp"), seed=3, num_layers=4, num_heads=4, num_kv_heads=2))


def test_uneven_splits_give_the_first_stages_one_layer_more():
    assert stage_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ValueError, match="2 layers do not split into 3 pipeline stages"):
        stage_layers(2, 3)


def test_each_stage_reads_and_holds_only_its_layers_and_their_kv_cache(dense, monkeypatch):
    monkeypatch.setattr(sizing, "agree_on_min", lambda value, tp: value)  # no group here: one stage alone
    full = build_model(ModelConfig.from_dir(dense), torch.float32, "cpu")
    for index, layers in enumerate(stage_layers(4, 3)):
        tp = TensorParallel(stage=PipelineStage(index, 3))
        model = build_model(full.config, torch.float32, "cpu", tp)
        reads: list[str] = []
        load_weights(model, ((name, Recording(name, source, reads)) for name, source in iterate_checkpoint(dense)))
        read_layers = {int(name.split(".")[2]) for name in reads if name.startswith("model.layers.")}
        assert read_layers == set(layers)
        assert [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, PipelineGap)] == list(layers)
        pool = sizing.build_kv_pool(model, InferenceConfig(device="cpu", num_kv_blocks=8, block_size_tokens=8), 64,
                             torch.device("cpu"))
        assert pool.shape[0] == len(layers)  # this stage's layers' KV only
        assert [bool(cache) for cache in pool.layer_caches] == [i in layers for i in range(layers.stop)]


def answers(model_dir: str, **config):
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8, device="cpu", **config))
    try:
        return answers_of(llm)
    finally:
        llm.close()


def answers_of(llm: MegatronLLM):
    outs = llm.generate(PROMPTS[:4], GREEDY)
    return [(o.generated_tokens, o.generated_log_probs, o.generated_top_n_logprobs) for o in outs]


@pytest.fixture(scope="module")
def three_stages(dense):
    """One group of three stages (2+1+1 layers, as many micro-batches as stages) for the tests that ask one: starting
    its ranks costs more than what each asks of it."""
    with MegatronLLM(dense, InferenceConfig(dtype="float32", block_size_tokens=8, device="cpu",
                                            pipeline_parallel_size=3)) as llm:
        yield llm


def assert_same_tokens(got, expected) -> None:
    """Greedy tokens equal, log probs within float32 noise (micro-batches run the GEMMs on fewer rows)."""
    for (tokens, log_probs, _), (tokens_1, log_probs_1, _) in zip(got, expected, strict=True):
        assert tokens == tokens_1
        assert log_probs == pytest.approx(log_probs_1, abs=1e-5)


@pytest.fixture(scope="module")
def one_stage(dense):
    return answers(dense)


@pytest.mark.slow
def test_two_and_three_stages_equal_one(dense, one_stage):
    """One micro-batch: each layer computes what it computes without stages, bitwise."""
    assert answers(dense, pipeline_parallel_size=2, pipeline_micro_batches=1) == one_stage
    assert answers(dense, pipeline_parallel_size=3, pipeline_micro_batches=1) == one_stage


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks_equal_one_stage_of_two(dense):
    assert_same_tokens(answers(dense, tensor_parallel_size=2, pipeline_parallel_size=2),
                       answers(dense, tensor_parallel_size=2))


def test_what_stages_do_not_serve_yet_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 does not serve LoRA adapters yet"):
        InferenceConfig(pipeline_parallel_size=2, enable_lora=True)
    moe = make_tiny_model(tmp_path, seed=1, arch="qwen3_moe")
    with pytest.raises(UnsupportedModelError, match="pipeline parallelism serves dense text models only"):
        build_model(ModelConfig.from_dir(str(moe)), torch.float32, "meta", TensorParallel(stage=PipelineStage(0, 2)))


@pytest.mark.slow
@pytest.mark.timeout(900)
# "ep2" is the same check over an expert-parallel group (each rank receives its experts): a near repeat of
# test_data_parallel_attention's coordinator test, whose trainer's refit reaches 2 x 2 expert-parallel ranks, each
# receiving its quarter of the experts; dropped here (a coordinator and a group of its own cost more than the check).
@pytest.mark.parametrize("layout", ["pp2"])
async def test_a_trainers_refit_reaches_every_rank_each_with_only_what_it_holds(layout, tmp_path):
    """The coordinator gives every rank of the group (stages included) a rank of the transfer; each receives and loads
    only what it holds (its stage's layers): the group then answers as the trainer's weights do on one rank, and no
    rank received the whole model."""
    arch = dict(num_layers=4) if layout == "pp2" else dict(arch="qwen3_moe", num_experts=8)
    before, after = (str(make_tiny_model(tmp_path / name, seed=seed, num_heads=4, num_kv_heads=2, **arch))
                     for name, seed in (("a", 1), ("b", 2)))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)
    with MegatronLLM(after, InferenceConfig(dtype="float32", device="cpu")) as one:
        expected = [o.generated_tokens for o in one.generate(PROMPTS[:3], params)]
    layout_config = (dict(pipeline_parallel_size=2) if layout == "pp2" else
                     dict(tensor_parallel_size=2, enable_expert_parallel=True))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(after, dtype=torch.float32)
    config = InferenceConfig(dtype="float32", device="cpu", num_kv_blocks=64, **layout_config)
    async with MegatronAsyncLLM(before, config, use_coordinator=True) as llm:
        assert [r.generated_tokens for r in await llm.generate(PROMPTS[:3], params)] != expected  # the control
        await llm.pause()
        ack = await llm.refit(trainer.named_parameters(), epoch=2)
        assert ack["detail"]["sender"]["world_size"] == 3  # the trainer and the group's two ranks
        total = sum(p.numel() * p.element_size() for p in trainer.parameters())
        received = {rank: facts["bytes"] for rank, facts in ack["detail"]["receivers"].items()}
        assert sorted(received) == [1, 2] and all(size < 0.8 * total for size in received.values()), received
        await llm.unpause()
        assert [r.generated_tokens for r in await llm.generate(PROMPTS[:3], params)] == expected


# The tests of the module's three stages last: its group is let go at the module's end.
@pytest.mark.slow
def test_micro_batches_across_stages_give_one_stages_tokens(dense, one_stage, request):
    """Four requests at once in 2 micro-batches over 2 stages, and in 3 over the uneven 2+1+1 (the default: as many
    as stages); and in the batch-invariant mode, where a row's bits do not depend on the rows beside it, log probs
    ``==`` one stage's."""
    assert_same_tokens(answers(dense, pipeline_parallel_size=2), one_stage)
    invariant = answers(dense, batch_invariant=True)
    assert answers(dense, pipeline_parallel_size=3, batch_invariant=True) == invariant
    # the module's group of three stages only now, after the others: a process holds one group at a time
    assert_same_tokens(answers_of(request.getfixturevalue("three_stages")), one_stage)


@pytest.mark.slow
def test_a_refit_from_a_directory_reaches_every_stage(dense, one_stage, three_stages, tmp_path):
    """Three stages (2+1+1 layers) refit from another checkpoint's directory (each stage loads its layers of it):
    the group then answers as that checkpoint does on one stage, and as before once refit back."""
    other = str(make_tiny_model(tmp_path / "other", seed=4, num_layers=4, num_heads=4, num_kv_heads=2))
    expected = answers(other)
    assert [row[0] for row in expected] != [row[0] for row in one_stage]  # the control: they answer differently
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)
    llm = three_stages
    llm.engine.memory.refit(other)
    try:
        assert [o.generated_tokens for o in llm.generate(PROMPTS[:4], params)] == [row[0] for row in expected]
    finally:
        llm.engine.memory.refit(dense)  # (the group is the module's: it answers as before for the tests after)
    assert [o.generated_tokens for o in llm.generate(PROMPTS[:4], params)] == [row[0] for row in one_stage]
