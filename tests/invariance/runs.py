"""One target request run in an engine beside random other traffic, and the same tokens through ``transformers``."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

from ..devices import tensor_parallel_device
from ..prompts import run_to_end

TARGET_TOKENS = 16
PREFIX = 32  # tokens of the target's prompt a warm-up request leaves in the prefix cache (two 16-token blocks)


def target_params(sampled: bool) -> SamplingParams:
    """Greedy, or sampled at temperature 1 with a seed (its draws are its own, whatever the batch)."""
    return SamplingParams(temperature=1.0 if sampled else 0.0, seed=7 if sampled else None,
                          num_tokens_to_generate=TARGET_TOKENS, ignore_eos=True, return_log_probs=True)


@dataclass
class Setup:
    """How the target runs: the engine's settings and the traffic around it."""

    others: int = 0
    max_batch_tokens: int = 512  # the prefill chunk: a prompt longer than this is split
    async_scheduling: bool = True
    num_kv_blocks: int | None = None  # small: requests are preempted and recomputed
    prefix_hit: bool = False  # the target's first blocks are in the prefix cache when it arrives
    tensor_parallel_size: int = 1
    quantization: str | None = None  # "fp8": the checkpoint's linears quantized at load

    def describe(self) -> str:
        parts = [f"{self.others} others", f"chunk {self.max_batch_tokens}"]
        parts += ["serial loop"] if not self.async_scheduling else []
        parts += [f"{self.num_kv_blocks} KV blocks"] if self.num_kv_blocks else []
        parts += ["prefix hit"] if self.prefix_hit else []
        parts += [f"TP={self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []
        parts += [f"quantization {self.quantization}"] if self.quantization else []
        return ", ".join(parts)


@dataclass
class TargetRun:
    prompt: list[int]
    tokens: list[int]
    log_probs: list[float]
    preemptions: int


def target_prompt(seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(40)]


def other_requests(count: int, adapters: tuple[str | None, ...] = (None,)) -> list[DynamicInferenceRequest]:
    """``count`` random requests to serve around a target (drawn from ``random.Random(count)``): prompts of 3 to 59
    tokens, 1 to 23 tokens each sampled at temperature 1 with its own seed; request ``i`` on
    ``adapters[i % len(adapters)]`` (``None``: the base model)."""
    rng = random.Random(count)
    return [DynamicInferenceRequest(f"other-{i}", None, [rng.randrange(5, 500) for _ in range(rng.randrange(3, 60))],
                                    SamplingParams(temperature=1.0, seed=i, ignore_eos=True,
                                                   lora_name=adapters[i % len(adapters)],
                                                   num_tokens_to_generate=rng.randrange(1, 24)))
            for i in range(count)]


def target_among(engine: DynamicInferenceEngine, params: SamplingParams, others: list[DynamicInferenceRequest]
                 ) -> tuple[list[int], list[float]]:
    """The target (:func:`target_prompt` with ``params``) served in the middle of ``others``, arriving with it: its
    tokens and log probs."""
    target = DynamicInferenceRequest("target", None, target_prompt(), params)
    run_all(engine, [*others[:len(others) // 2], target, *others[len(others) // 2:]])
    return target.generated_tokens, target.generated_log_probs


def run_target(model_dir: str, dtype: str, invariant: bool, setup: Setup, sampled: bool = False) -> TargetRun:
    """The target's tokens and log probs with ``setup``'s traffic around it (others arrive with it, half before)."""
    config = InferenceConfig(dtype=dtype, device=tensor_parallel_device(setup.tensor_parallel_size),
                             batch_invariant=invariant, block_size_tokens=16,
                             max_batch_tokens=setup.max_batch_tokens, async_scheduling=setup.async_scheduling,
                             num_kv_blocks=setup.num_kv_blocks, tensor_parallel_size=setup.tensor_parallel_size,
                             quantization=setup.quantization)
    engine = DynamicInferenceEngine.from_model_dir(model_dir, config)
    try:
        rng = random.Random(setup.others)
        prompt = target_prompt()
        if setup.prefix_hit:
            # its prompt's blocks are what it leaves: one generated token, not the target's 16 decode steps
            warm = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True)
            run_all(engine, [DynamicInferenceRequest("warm", None, prompt[:PREFIX] + [3], warm)])
        requests = []
        for index in range(setup.others):
            length = rng.randrange(3, 60)
            params = SamplingParams(temperature=1.0, seed=index if index % 2 else None, ignore_eos=True,
                                    num_tokens_to_generate=rng.randrange(1, 24))
            requests.append(DynamicInferenceRequest(f"other-{index}", None,
                                                    [rng.randrange(5, 500) for _ in range(length)], params))
        target = DynamicInferenceRequest("target", None, prompt, target_params(sampled))
        requests.insert(len(requests) // 2, target)
        run_all(engine, requests)
        if setup.prefix_hit:
            assert target.cached_tokens == PREFIX, f"the target found {target.cached_tokens} cached tokens"
        return TargetRun(prompt, target.generated_tokens, target.generated_log_probs,
                         engine.stats.counters["num_preemptions"])
    finally:
        engine.shutdown()


def run_all(engine: DynamicInferenceEngine, requests: list[DynamicInferenceRequest]) -> None:
    """Add every request, step until all finished."""
    run_to_end(engine, requests)


def trainer_log_probs(model_dir: str, dtype: str, run: TargetRun, invariant: bool) -> list[float]:
    """What a trainer computes for the run's tokens: a teacher-forced ``transformers`` forward over prompt +
    completion, ``log_softmax(logits.float())`` at each completion token; with ``invariant`` under
    ``batch_invariant()`` and ``megatron_invariant`` attention, else as it loads by default."""
    import transformers  # noqa: PLC0415 - the trainer's library, only where a test plays the trainer

    from megatron_serve.invariant import ATTENTION_NAME, batch_invariant, use_invariant_norms  # noqa: PLC0415

    config = transformers.AutoConfig.from_pretrained(model_dir)
    moe = any(hasattr(config, name) for name in ("num_experts", "num_local_experts"))
    # The experts' eager loop: the default grouped GEMM rounds Mixtral's bf16 experts differently.
    experts = {"experts_implementation": "eager"} if moe and invariant else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=ATTENTION_NAME if invariant else "sdpa", **experts)
    model = model.to(tensor_parallel_device(1)).eval()  # where the engine ran
    if invariant:  # the recipe: on a GPU the engine's norm is its Triton kernel (on CPU the same ops as before)
        use_invariant_norms(model)
    ids = torch.tensor([run.prompt + run.tokens], device=model.device)
    with torch.inference_mode():
        if invariant:
            with batch_invariant():
                logits = model(ids).logits
        else:
            logits = model(ids).logits
    log_probs = torch.log_softmax(logits.float(), -1)[0]
    start = len(run.prompt) - 1
    return [log_probs[start + i, token].item() for i, token in enumerate(run.tokens)]


def differing(a: list[float], b: list[float]) -> int:
    """How many positions differ at all (``!=`` on the floats)."""
    assert len(a) == len(b), f"{len(a)} log probs against {len(b)}"
    return sum(x != y for x, y in zip(a, b))


#: The framework recipes' comparisons (Megatron-core, TorchTitan): these prompts' completions, right-padded to
#: ``RECIPE_LENGTH`` (past the longest sequence, 45 tokens), served once per (arch, dtype) for both.
RECIPE_PROMPTS = [[7, 8, 9] * 10, [11, 12] * 7, [(13 * i) % 500 + 5 for i in range(37)]]
RECIPE_COMPLETION = 8
RECIPE_LENGTH = 48


def run_prompts(model_dir: str, dtype: str, prompts: list[list[int]], tokens: int = TARGET_TOKENS,
                sampled: bool = False) -> list[TargetRun]:
    """Every prompt served at once by one engine in the mode: each one's completion and log probs (its own,
    whatever the batch: the engine's invariance is held by ``test_engine_invariance``)."""
    config = InferenceConfig(dtype=dtype, device=tensor_parallel_device(1), batch_invariant=True, block_size_tokens=16)
    engine = DynamicInferenceEngine.from_model_dir(model_dir, config)
    try:
        params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=7 if sampled else None,
                                num_tokens_to_generate=tokens, ignore_eos=True, return_log_probs=True)
        requests = [DynamicInferenceRequest(f"r{i}", None, prompt, params) for i, prompt in enumerate(prompts)]
        run_all(engine, requests)
        return [TargetRun(r.prompt_tokens, r.generated_tokens, r.generated_log_probs, 0) for r in requests]
    finally:
        engine.shutdown()


def load_trainer_model(model_dir: str, dtype: str, **kwargs):
    """The recipe's model: ``megatron_invariant`` attention, the experts' eager loop for an MoE (the default
    grouped GEMM rounds Mixtral's bf16 experts differently), loaded in the engine's dtype where it ran."""
    import transformers  # noqa: PLC0415 - the trainer's library, only where a test plays the trainer

    from megatron_serve.invariant import ATTENTION_NAME  # noqa: PLC0415

    config = transformers.AutoConfig.from_pretrained(model_dir)
    moe = any(hasattr(config, name) for name in ("num_experts", "num_local_experts"))
    experts = {"experts_implementation": "eager"} if moe else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=ATTENTION_NAME, **experts, **kwargs)
    return model.to(tensor_parallel_device(1))
