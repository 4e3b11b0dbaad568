"""Mixture-of-experts models against ``transformers``: greedy tokens and the routing of every token.

The reference is a greedy loop over ``transformers``' own forward with its KV cache and
``output_router_logits=True``, one prompt at a time: it yields the tokens and, for every token the
model processed, the top-k experts of its router (no EOS handling, so a tiny model that prefers EOS
still generates 16 tokens). Our engine runs the prompts together, half of them asking for
``routing_indices``; every answer must equal the reference, also when a small KV pool forces
preemptions and recomputation, when the prefix cache already holds the prompt, and at TP=2
(every expert's intermediate dimension split over two gloo ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.request import DynamicInferenceRequest, EventType
from megatron_serve.model.tiny import make_tiny_model

from ..devices import tensor_parallel_device
from ..prompts import PROMPTS, run_to_end

NEW_TOKENS = 16  # each further step checks one more token and its routing alike (32 before: twice the cost)

VARIANTS = {
    "mixtral": dict(arch="mixtral"),
    # shared expert and its gate; top-k weights not renormalised; only layer 1 of 3 sparse (decoder_sparse_step)
    "qwen2_moe": dict(arch="qwen2_moe", num_layers=3, decoder_sparse_step=2),
    # renormalised top-4 of 16 experts; layer 1 of 3 dense (mlp_only_layers)
    "qwen3_moe": dict(arch="qwen3_moe", num_layers=3, mlp_only_layers=[1], num_experts=16, num_experts_per_tok=4),
}


def hf_greedy_with_routing(model, tokens: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], np.ndarray]:
    """``new_tokens`` greedy tokens, and ``[processed tokens, MoE layers, top_k]`` expert ids of the router's top-k."""
    top_k = model.config.num_experts_per_tok
    cache = transformers.DynamicCache(config=model.config)
    ids, generated, routing = torch.tensor([tokens]), [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(ids, past_key_values=cache, use_cache=True, output_router_logits=True)
            routing.append(torch.stack([torch.topk(torch.softmax(r.float(), -1), top_k).indices
                                        for r in out.router_logits], dim=1))
            generated.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[generated[-1]]])
    return generated, torch.cat(routing).numpy()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_case(request, tmp_path_factory):
    """A tiny MoE model and the reference answer for each prompt."""
    model_dir = str(make_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, **VARIANTS[request.param]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", num_kv_blocks=1))  # only for its tokenizer
    token_lists = [llm.tokenizer.encode(p) for p in PROMPTS[:6]]
    assert len({len(t) for t in token_lists}) == len(token_lists), "prompts must differ in length"
    return model_dir, token_lists, [hf_greedy_with_routing(hf, tokens) for tokens in token_lists]


def run_together(llm: MegatronLLM, token_lists: list[list[int]], with_routing: list[bool]
                 ) -> list[DynamicInferenceRequest]:
    """Every prompt in one engine at once, each with its own ``return_routing_indices``."""
    requests = [DynamicInferenceRequest(f"r{i}", None, tokens, SamplingParams(
        temperature=0.0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True, return_routing_indices=asks))
        for i, (tokens, asks) in enumerate(zip(token_lists, with_routing))]
    return run_to_end(llm.engine, requests)


def check_against_reference(requests, token_lists, reference, with_routing):
    for request, tokens, (expected_tokens, expected_routing), asks in zip(requests, token_lists, reference,
                                                                          with_routing):
        assert request.error is None
        assert request.generated_tokens == expected_tokens
        if not asks:
            assert request.routing_indices is None
            continue
        # every processed token: the prompt and all generated tokens but the last (sampled, never processed)
        assert request.routing_indices.shape == (len(tokens) + NEW_TOKENS - 1, *expected_routing.shape[1:])
        np.testing.assert_array_equal(request.routing_indices, expected_routing)


def test_greedy_tokens_and_routing_equal_transformers(moe_case):
    model_dir, token_lists, reference = moe_case
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=16))
    with_routing = [i % 2 == 0 for i in range(len(token_lists))]
    check_against_reference(run_together(llm, token_lists, with_routing), token_lists, reference, with_routing)


def test_preemption_changes_neither_tokens_nor_routing(moe_case):
    model_dir, token_lists, reference = moe_case
    # 8 blocks of 8 tokens hold about two of these requests at full length (prompts of 2 to 31 tokens and 16
    # generated: 3 to 6 blocks each): the rest wait or are preempted.
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8, num_kv_blocks=8,
                                                 max_batch_tokens=64))
    with_routing = [i % 2 == 1 for i in range(len(token_lists))]
    requests = run_together(llm, token_lists, with_routing)
    preempted = [r for r in requests if any(e.type is EventType.PREEMPT for e in r.events)]
    assert any(with_routing[int(r.request_id[1:])] for r in preempted), "no request that records was preempted"
    check_against_reference(requests, token_lists, reference, with_routing)


def test_routing_requests_compute_the_prompt_the_prefix_cache_holds(moe_case):
    model_dir, token_lists, reference = moe_case
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8, enable_prefix_caching=True))
    longest = max(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    tokens = [token_lists[longest]]
    first = run_together(llm, tokens, [False])[0]
    cached, recorded = run_together(llm, tokens * 2, [False, True])
    assert first.cached_tokens == 0 and cached.cached_tokens >= 8  # the cache holds the prompt...
    assert recorded.cached_tokens == 0  # ...but a request that records its routing computes every token itself
    check_against_reference([recorded], tokens, [reference[longest]], [True])


@pytest.mark.slow
def test_tp2_equals_transformers(moe_case):
    model_dir, token_lists, reference = moe_case
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8, tensor_parallel_size=2,
                                                 device=tensor_parallel_device(2)))
    try:
        with_routing = [True] * len(token_lists)
        check_against_reference(run_together(llm, token_lists, with_routing), token_lists, reference, with_routing)
    finally:
        llm.close()


def test_dense_model_refuses_routing_indices(tiny_llama):
    llm = MegatronLLM(tiny_llama, InferenceConfig(dtype="float32"))
    out = llm.generate(["Hello"], SamplingParams(num_tokens_to_generate=2, return_routing_indices=True))[0]
    assert out.status.value == "FAILED"
    assert "return_routing_indices needs a mixture-of-experts model" in out.error
    assert "LlamaForCausalLM" in out.error


def test_qwen2_moe_without_a_shared_expert_loads_and_equals_transformers(tmp_path):
    """shared_expert_intermediate_size=0: transformers still writes an empty shared expert and its gate (their
    product is zero). The engine refused the checkpoint ("... shared_expert.down_proj.weight has no place",
    parity search cases 440-447 and 760-767); it loads it and answers as transformers does."""
    model_dir = str(make_tiny_model(tmp_path, seed=2, arch="qwen2_moe", shared_expert_intermediate_size=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", block_size_tokens=8))
    token_lists = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    reference = [hf_greedy_with_routing(hf, tokens) for tokens in token_lists]
    check_against_reference(run_together(llm, token_lists, [True] * 3), token_lists, reference, [True] * 3)
