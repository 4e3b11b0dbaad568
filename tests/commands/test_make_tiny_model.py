"""``megatron-serve make-tiny-model``: mixture-of-experts architectures and their expert options."""

from __future__ import annotations

from megatron_serve import cli
from megatron_serve.model.config import ModelConfig


def test_qwen3_moe_with_chosen_experts(tmp_path, capsys):
    assert cli.main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3_moe", "--experts", "4",
                     "--experts-per-token", "1"]) == 0
    config = ModelConfig.from_dir(tmp_path / "m")
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert (config.moe.num_experts, config.moe.top_k, config.moe.sparse_layers) == (4, 1, (0, 1))
    assert "wrote a tiny qwen3_moe model" in capsys.readouterr().out


def test_mixtral_defaults_to_eight_experts_two_per_token(tmp_path):
    assert cli.main(["make-tiny-model", str(tmp_path / "m"), "--arch", "mixtral"]) == 0
    moe = ModelConfig.from_dir(tmp_path / "m").moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (8, 2, True)


def test_expert_options_need_an_moe_arch(tmp_path, capsys):
    assert cli.main(["make-tiny-model", str(tmp_path / "m"), "--arch", "llama", "--experts", "4"]) == 2
    assert "--experts and --experts-per-token need a mixture-of-experts arch" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_benchmark_shape_with_a_real_models_vocabulary_serves(tmp_path):
    """--vocab-size pads the tokenizer (the model's vocabulary is the tokenizer's full size); ids of the placeholder
    tokens decode to text, as a serving benchmark drawing ids from the whole vocabulary needs."""
    from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams  # noqa: PLC0415

    assert cli.main(["make-tiny-model", str(tmp_path / "m"), "--vocab-size", "3000", "--tie-word-embeddings"]) == 0
    config = ModelConfig.from_dir(tmp_path / "m")
    assert (config.vocab_size, config.tie_word_embeddings) == (3000, True)
    llm = MegatronLLM(str(tmp_path / "m"), InferenceConfig(num_kv_blocks=16))
    [out] = llm.generate([[2999, 1500, 7]], SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True))
    assert len(out.generated_tokens) == 4 and llm.tokenizer.decode([2999]).startswith("<|filler_")
