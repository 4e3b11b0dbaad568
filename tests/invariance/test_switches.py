"""How ``--batch-invariant`` is switched on: the config field, vLLM's environment variable, the CLI, the fleet's
argv; and what it refuses."""

from __future__ import annotations

import argparse
import logging

import pytest

from megatron_serve import InferenceConfig
from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.fleet.argv import inference_config_to_argv
from megatron_serve.model import UnsupportedModelError
from megatron_serve.model.tiny import make_tiny_model


@pytest.mark.parametrize(("env", "expected"), [(None, False), ("0", False), ("1", True)])
def test_vllm_batch_invariant_sets_the_default(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", env)
    assert InferenceConfig(device="cpu").batch_invariant is expected
    assert InferenceConfig(device="cpu", batch_invariant=not expected).batch_invariant is not expected


def test_bad_values_are_rejected_by_name(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 0 or 1"):
        InferenceConfig(device="cpu")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        InferenceConfig(device="cpu", batch_invariant="yes")


@pytest.mark.parametrize(("argv", "env", "expected"), [([], "1", True), ([], "0", False),
                                                       (["--batch-invariant"], "0", True),
                                                       (["--no-batch-invariant"], "1", False)])
def test_the_flag_overrides_the_environment_and_crosses_to_engines(monkeypatch, argv, env, expected):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", env)
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = inference_config_from_args(parser.parse_args(["--device", "cpu", *argv]))
    assert config.batch_invariant is expected
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0" if expected else "1")  # an engine's own environment differs
    rebuilt = inference_config_from_args(parser.parse_args(inference_config_to_argv(config)))
    assert rebuilt.to_dict() == config.to_dict()


def test_vision_models_are_refused_in_the_mode(tmp_path):
    vision = make_tiny_model(tmp_path / "vlm", seed=0, arch="qwen2_vl")
    with pytest.raises(UnsupportedModelError, match="--batch-invariant supports text models only"):
        DynamicInferenceEngine.from_model_dir(vision, InferenceConfig(batch_invariant=True))


def test_every_engine_option_crosses_to_fleet_engines():
    """Each field the engine options set is on the fleet's argv (``--logprobs-mode`` once was not, and fleet
    engines reported raw log probs in a processed mode): a config with the mode and other fields off their
    defaults comes back equal."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    defaults = inference_config_from_args(parser.parse_args(["--device", "cpu"]))
    changed = inference_config_from_args(parser.parse_args([
        "--device", "cpu", "--logprobs-mode", "processed_logprobs", "--batch-invariant", "--seed", "3",
        "--verify-logprobs-fraction", "0.5", "--max-batch-tokens", "256", "--dtype", "float32",
        "--trainer-tensor-parallel-size", "2"]))
    assert changed.logprobs_mode != defaults.logprobs_mode
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(changed))).to_dict() == changed.to_dict()


@pytest.mark.parametrize("trainer, warned", [(2, True), (1, False), (None, False)])
def test_an_engine_at_another_tensor_parallel_size_than_the_trainer_warns_at_start(models, caplog, trainer, warned):
    config = InferenceConfig(device="cpu", batch_invariant=True, trainer_tensor_parallel_size=trainer)
    with caplog.at_level(logging.WARNING, logger="megatron_serve.engine.core"):
        DynamicInferenceEngine.from_model_dir(models["llama"], config).shutdown()
    messages = [r.getMessage() for r in caplog.records if "--trainer-tensor-parallel-size" in r.getMessage()]
    assert len(messages) == int(warned), messages
    if warned:
        assert "tensor-parallel size 1, but the trainer runs at 2" in messages[0]


def test_expert_parallelism_over_tensor_parallel_ranks_computes_as_one_rank_for_the_seam():
    """Under ``--batch-invariant`` expert parallelism at TP 2 gathers its row-parallel layers' input: the engine's log
    probs are one rank's (tests/parallel/test_data_parallel_attention.py), so a trainer at size 1 is its match."""
    def warning(trainer: int, **config) -> str | None:
        return InferenceConfig(device="cpu", batch_invariant=True, tensor_parallel_size=2,
                               trainer_tensor_parallel_size=trainer, **config).trainer_seam_warning()

    assert warning(1, enable_expert_parallel=True) is None
    assert "size 2 with expert parallelism (computing as one rank), but the trainer runs at 2" in warning(
        2, enable_expert_parallel=True)
    assert "size 2, but the trainer runs at 1" in warning(1)  # the control: TP alone adds partial sums
    assert InferenceConfig(device="cpu", batch_invariant=True, tensor_parallel_size=2, enable_expert_parallel=True,
                           enable_lora=True).gathers_rows  # adapters' deltas too (tests/parallel/test_lora_eplb.py)


def test_a_bad_trainer_tensor_parallel_size_is_refused_by_name():
    with pytest.raises(ValueError, match="trainer_tensor_parallel_size must be a positive integer"):
        InferenceConfig(device="cpu", trainer_tensor_parallel_size=0)
