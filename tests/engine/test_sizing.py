"""What the KV pool leaves for serving on a GPU: a reserve for step activations, logits and CUDA graphs."""

from __future__ import annotations

from megatron_serve import InferenceConfig
from megatron_serve.engine.precompile.graphs import largest_graph
from megatron_serve.engine.sizing import serving_reserve_bytes
from megatron_serve.model.config import ModelConfig

# Llama-3.2-1B's shape (what the serving benchmark runs), bf16
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


def test_the_reserve_covers_logits_activations_and_graphs(tmp_path):
    import json  # noqa: PLC0415

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    model = ModelConfig.from_dir(tmp_path)
    config = InferenceConfig(device="cpu", max_requests=256, max_batch_tokens=2048)
    without_graphs = serving_reserve_bytes(model, config, 2, 1, graph_tokens=0)
    with_graphs = serving_reserve_bytes(model, config, 2, 1, graph_tokens=512)
    logits = 256 * 128256 * 4  # float32 logits of every running request, before the sampler's copies
    assert 4 * logits < without_graphs < with_graphs < 1.5 * 2**30
    assert serving_reserve_bytes(model, config, 2, 2, graph_tokens=512) < with_graphs  # TP shards activations
    assert serving_reserve_bytes(model, InferenceConfig(device="cpu", max_requests=64), 2, 1, 0) < without_graphs


def test_only_an_engine_that_captures_graphs_reserves_for_them():
    import torch  # noqa: PLC0415

    cuda = torch.device("cuda")  # nothing is allocated: only whether and how large graphs would be
    assert largest_graph(InferenceConfig(device="cuda", max_requests=64), cuda) == 128  # up to 2 x max_num_seqs
    assert largest_graph(InferenceConfig(device="cuda", max_requests=256, max_batch_tokens=300), cuda) == 300
    assert largest_graph(InferenceConfig(device="cuda", cuda_graph_sizes=[1, 96]), cuda) == 96
    assert largest_graph(InferenceConfig(device="cuda", enable_cuda_graphs=False), cuda) == 0
    assert largest_graph(InferenceConfig(device="cpu"), torch.device("cpu")) == 0
