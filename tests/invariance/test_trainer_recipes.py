"""The trainer recipes of docs/batch-invariance.md beyond a plain checkpoint, each ``==`` the engine with a control:

* PEFT LoRA: the adapter the engine serves, applied by PEFT with ``use_invariant_lora`` (the control: PEFT's
  own GEMMs, scaled after, round otherwise in bfloat16);
* FP8: ``write_dequantized_checkpoint`` writes the weights the engine computes with, for ``--quantization
  fp8`` and for a block-wise FP8 checkpoint (the control: the unquantized checkpoint);
* temperature: ``log_softmax(logits / T)`` is the engine's processed log prob (the control: ``logits * (1/T)``);
* MoE routing replay: ``replay_routing`` with the engine's ``routing_indices`` keeps the log probs, and a
  router moved since the rollout (an optimizer step) still picks the engine's experts (the control: without
  the replay it picks others).
"""

from __future__ import annotations

import pytest
import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.invariant import batch_invariant, replay_routing, use_invariant_lora
from megatron_serve.model.dequantized import write_dequantized_checkpoint

from ..fp8_checkpoints import block_fp8_checkpoint
from ..lora_adapters import make_peft_adapter
from .runs import Setup, TargetRun, load_trainer_model, run_all, run_target, target_prompt

MAX_LORA_RANK = 8


def _log_probs(model: torch.nn.Module, run: TargetRun, temperature: float | None = None) -> list[float]:
    with torch.no_grad(), batch_invariant():
        logits = model(torch.tensor([run.prompt + run.tokens], device=model.device)).logits.float()[0]
    log_probs = torch.log_softmax(logits if temperature is None else logits / temperature, -1)
    return [log_probs[len(run.prompt) - 1 + i, token].item() for i, token in enumerate(run.tokens)]


def _engine(model_dir: str, dtype: str, params: SamplingParams, **config) -> DynamicInferenceRequest:
    engine = DynamicInferenceEngine.from_model_dir(model_dir, InferenceConfig(
        dtype=dtype, block_size_tokens=16, batch_invariant=True, **config))
    try:
        request = DynamicInferenceRequest("target", None, target_prompt(), params)
        run_all(engine, [request])
        return request
    finally:
        engine.shutdown()


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, return_log_probs=True, **extra)


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("recipe-adapters")
    return {"rank 4 of 8, q/v/down": str(make_peft_adapter(models["llama"], root / "a", rank=4, seed=2,
                                                           targets=["q_proj", "v_proj", "down_proj"])),
            "rank 8, every projection": str(make_peft_adapter(models["llama"], root / "b", rank=8, seed=3))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("adapter", ["rank 4 of 8, q/v/down", "rank 8, every projection"])
def test_a_peft_lora_adapter_gives_the_engines_log_probs(models, adapters, adapter, dtype):
    import peft  # noqa: PLC0415 - test extra

    served = _engine(models["llama"], dtype, _greedy(lora_name="a"), enable_lora=True, max_loras=1,
                     max_lora_rank=MAX_LORA_RANK, lora_modules={"a": adapters[adapter]})
    run = TargetRun(served.prompt_tokens, served.generated_tokens, served.generated_log_probs, 0)
    model = peft.PeftModel.from_pretrained(load_trainer_model(models["llama"], dtype), adapters[adapter]).eval()
    plain = _log_probs(model, run)
    assert use_invariant_lora(model, MAX_LORA_RANK) == (6 if adapter.startswith("rank 4") else 14)
    assert _log_probs(model, run) == run.log_probs
    if dtype == "bfloat16":  # the control: PEFT's float32 GEMMs, scaled after
        assert plain != run.log_probs


def test_use_invariant_lora_refuses_what_the_engine_does_not_serve(models, adapters):
    import peft  # noqa: PLC0415

    model = peft.PeftModel.from_pretrained(load_trainer_model(models["llama"], "float32"),
                                           adapters["rank 8, every projection"]).eval()
    use_invariant_lora(model, 4)
    with pytest.raises(ValueError, match="rank 8, more than max_lora_rank 4"):
        _log_probs(model, TargetRun([5, 6, 7], [8], [0.0], 0))


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3_moe", "bfloat16")])
def test_fp8_quantized_at_load_the_dequantized_checkpoint_gives_the_engines_log_probs(models, tmp_path, arch, dtype):
    run = run_target(models[arch], dtype, True, Setup(others=7, quantization="fp8"))
    written = write_dequantized_checkpoint(models[arch], tmp_path / "dequantized", quantization="fp8")
    assert _log_probs(load_trainer_model(str(written), dtype).eval(), run) == run.log_probs
    assert _log_probs(load_trainer_model(models[arch], dtype).eval(), run) != run.log_probs  # the control


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_block_fp8_checkpoint_dequantized_gives_the_engines_log_probs(models, tmp_path, arch):
    checkpoint = block_fp8_checkpoint(models[arch], tmp_path / "fp8", block=(16, 16))
    run = run_target(str(checkpoint), "bfloat16", True, Setup(others=7))
    written = write_dequantized_checkpoint(checkpoint, tmp_path / "dequantized")
    assert _log_probs(load_trainer_model(str(written), "bfloat16").eval(), run) == run.log_probs
    assert _log_probs(load_trainer_model(models[arch], "bfloat16").eval(), run) != run.log_probs  # the control


def test_an_unquantized_checkpoint_is_refused_without_quantization(models, tmp_path):
    with pytest.raises(ValueError, match="has no FP8 weights"):
        write_dequantized_checkpoint(models["llama"], tmp_path / "out")


@pytest.mark.parametrize("temperature", [0.7, 0.6])
def test_temperature_as_a_division_gives_the_processed_log_probs(models, temperature):
    # 32 tokens: the control's multiplication moves a chosen token's log prob only where a logit's last bit outlives
    # the log-sum-exp's subtraction; 12 tokens at 0.7 showed none on one CPU (a Sapphire Rapids)
    served = _engine(models["llama"], "float32", SamplingParams(
        temperature=temperature, seed=5, num_tokens_to_generate=32, ignore_eos=True, return_log_probs=True),
        logprobs_mode="processed_logprobs")
    run = TargetRun(served.prompt_tokens, served.generated_tokens, served.generated_log_probs, 0)
    model = load_trainer_model(models["llama"], "float32").eval()
    assert _log_probs(model, run, temperature) == run.log_probs
    with torch.no_grad(), batch_invariant():  # the control: a multiplication by the inverse rounds otherwise
        logits = model(torch.tensor([run.prompt + run.tokens], device=model.device)).logits.float()[0]
    by_inverse = torch.log_softmax(logits * (1 / temperature), -1)
    assert [by_inverse[len(run.prompt) - 1 + i, t].item() for i, t in enumerate(run.tokens)] != run.log_probs


def _routing_of(model: torch.nn.Module, ids: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """The experts each router picked in one forward: ``[tokens, layers, top_k]``."""
    picked = []
    hooks = [module.register_forward_hook(lambda _m, _a, out: picked.append(out[2]))
             for module in model.modules() if type(module).__name__.endswith("TopKRouter")]
    try:
        with torch.no_grad(), batch_invariant():
            if replay is None:
                model(ids)
            else:
                with replay_routing(model, replay):
                    model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(picked, 1)


def test_routing_replay_keeps_the_log_probs_and_the_engines_experts_after_a_router_moves(models):
    served = _engine(models["qwen3_moe"], "float32", _greedy(return_routing_indices=True))
    run = TargetRun(served.prompt_tokens, served.generated_tokens, served.generated_log_probs, 0)
    tokens = len(run.prompt) + len(run.tokens)
    routing = torch.as_tensor(served.routing_indices)
    assert routing.shape[0] == tokens - 1  # every processed token: the last one was never fed back
    replay = torch.cat([routing, routing[-1:]])  # the last token's logits are not read
    model = load_trainer_model(models["qwen3_moe"], "float32").eval()
    with replay_routing(model, replay):
        assert _log_probs(model, run) == run.log_probs
    ids = torch.tensor([run.prompt + run.tokens], device=model.device)
    routing = routing.to(model.device)
    assert torch.equal(_routing_of(model, ids, None)[:-1], routing)  # the same weights: the same experts
    with torch.no_grad():  # an optimizer step moves the routers
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.add_(torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(0)).to(module.weight))
    assert torch.equal(_routing_of(model, ids, replay)[:-1], routing)
    assert not torch.equal(_routing_of(model, ids, None)[:-1], routing)  # the control
