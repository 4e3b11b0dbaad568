"""FP8 checkpoints as users download them: compressed-tensors (written by compressed-tensors itself) and the
block-wise ``quant_method: "fp8"`` layout, dense, MoE and the text side of a vision-language model.

The engine serves FP8 weights here by dequantizing them (the reference path, forced on a GPU too, whose
Triton path quantizes prefill activations: tests/engine/test_fp8_serving.py), so its tokens and log
probs must equal, bit for bit, the engine's on the dequantized weights. transformers runs the same
checkpoints on CPU by dequantizing too, but compressed-tensors also rounds every linear layer's input
to e4m3 (fake-quantized activations): there the engine's greedy tokens must be transformers' own
wherever transformers' top token leads ours by more than ``MARGIN``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model import UnsupportedModelError
from megatron_serve.model.loader import load_model
from megatron_serve.model.tiny import make_tiny_model

from ..fp8_checkpoints import (
    block_fp8_checkpoint,
    compressed_tensors_checkpoint,
    dequantized_checkpoint,
    edited_checkpoint,
)
from ..prompts import PROMPTS

NEW_TOKENS = 16
# Logits of these random models have a standard deviation of about 0.16; e4m3 activations (relative
# rounding up to 2^-4) moved transformers' logits by less than 0.01 wherever its top token changed.
MARGIN = 0.02
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS, ignore_eos=True, return_log_probs=True)

# name -> (tiny model arch, writer of the FP8 checkpoint)
FORMATS = {
    "ct-FP8-static-llama": ("llama", lambda src, dst: compressed_tensors_checkpoint(src, dst, "FP8")),
    "ct-FP8_DYNAMIC-qwen2": ("qwen2", lambda src, dst: compressed_tensors_checkpoint(src, dst, "FP8_DYNAMIC")),
    "ct-FP8_BLOCK-qwen3": ("qwen3", lambda src, dst: compressed_tensors_checkpoint(src, dst, "FP8_BLOCK", (16, 16))),
    "ct-FP8_DYNAMIC-qwen3_moe": ("qwen3_moe",
                                 lambda src, dst: compressed_tensors_checkpoint(src, dst, "FP8_DYNAMIC")),
    "block-fp8-llama": ("llama", lambda src, dst: block_fp8_checkpoint(src, dst, (16, 32))),
    "block-fp8-qwen2_moe": ("qwen2_moe", lambda src, dst: block_fp8_checkpoint(src, dst, (16, 16))),
    "block-fp8-mixtral": ("mixtral", lambda src, dst: block_fp8_checkpoint(src, dst, (32, 16))),
    "ct-FP8_DYNAMIC-qwen2_vl": ("qwen2_vl", lambda src, dst: compressed_tensors_checkpoint(src, dst, "FP8_DYNAMIC")),
}


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """Every engine here on the reference ops (resolved when its model is built), whatever the device."""
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every format's FP8 checkpoint and its dequantized twin, written once for the module."""
    root = tmp_path_factory.mktemp("fp8")
    made = {}
    for name, (arch, write) in FORMATS.items():
        base = make_tiny_model(root / f"{name}-base", seed=1, arch=arch)
        quantized = write(base, root / name)
        made[name] = (quantized, dequantized_checkpoint(quantized, root / f"{name}-dequantized"))
    return made


@pytest.fixture(scope="module")
def served() -> dict[Path, tuple[list, list]]:
    """Each FP8 checkpoint's token lists and greedy outputs, kept by the first test that serves it: the engine's run
    is the same for the next test that compares it."""
    return {}


def _generate(model_dir: Path, **config) -> tuple[MegatronLLM, list, list]:
    llm = MegatronLLM(str(model_dir), InferenceConfig(dtype="float32", block_size_tokens=16, **config))
    token_lists = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(token_lists, GREEDY)
    return llm, token_lists, [(o.generated_tokens, o.generated_log_probs) for o in outs]


def _fp8_parameters(llm: MegatronLLM) -> int:
    return sum(p.numel() for p in llm.engine.model.parameters() if p.dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_reference_path_equals_the_engine_on_dequantized_weights(checkpoints, served, name):
    quantized, dequantized = checkpoints[name]
    llm, token_lists, fp8_outputs = _generate(quantized)
    served[quantized] = (token_lists, fp8_outputs)
    # the decoder's linears (experts included) are FP8 in memory: the format was not silently ignored
    assert _fp8_parameters(llm) > 0.8 * sum(p.numel() for n, p in llm.engine.model.named_parameters()
                                            if "proj" in n and "vision" not in n)
    _, _, dense_outputs = _generate(dequantized)
    assert fp8_outputs == dense_outputs


@pytest.mark.parametrize("name", ["ct-FP8-static-llama", "ct-FP8_BLOCK-qwen3", "ct-FP8_DYNAMIC-qwen3_moe",
                                  "block-fp8-llama", "block-fp8-mixtral"])
def test_greedy_tokens_are_transformers_where_its_margin_allows(checkpoints, served, name):
    quantized, _ = checkpoints[name]
    token_lists, outputs = served[quantized] if quantized in served else _generate(quantized)[1:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32,
                                                           **_dequantized_on_load(quantized)).eval()
    compared = exact = 0
    for prompt, (generated, _) in zip(token_lists, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
        for row, token in zip(logits, generated):
            compared += 1
            exact += int(row.argmax()) == token
            assert row.max() - row[token] < MARGIN, f"{name}: transformers prefers {int(row.argmax())} over {token}"
    if name.startswith("block"):  # transformers dequantizes these and leaves activations alone: same model
        assert exact == compared
    assert exact >= 0.9 * compared


def _dequantized_on_load(checkpoint: Path) -> dict:
    """transformers' loading options that dequantize a block-FP8 checkpoint to float on any device: where CUDA is
    available it keeps the weights FP8 and calls the ``kernels`` package's GEMM instead (absent on the GPU image)."""
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    if config["quant_method"] != "fp8":
        return {}
    return {"quantization_config": transformers.FineGrainedFP8Config.from_dict({**config, "dequantize": True})}


def _quantization_config(**groups_and_format) -> dict:
    """A ``quantization_config`` as compressed-tensors writes it for a preset scheme."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset, fmt = groups_and_format["preset"], groups_and_format["format"]
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"], format=fmt)
    return {"quant_method": "compressed-tensors", **json.loads(config.model_dump_json(exclude={"quant_method"}))}


@pytest.mark.parametrize(("quantization_config", "named"), [
    (dict(preset="W4A16", format="pack-quantized"), "INT4"),
    (dict(preset="NVFP4", format="nvfp4-pack-quantized"), "NVFP4"),
    (dict(preset="W8A8", format="int-quantized"), "INT8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
])
def test_unsupported_schemes_are_refused_naming_them(tmp_path, quantization_config, named):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=1)
    if "preset" in quantization_config:
        quantization_config = _quantization_config(**quantization_config)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(model_dir, torch.float32, "cpu")


Q = "model.layers.0.self_attn.q_proj"


def _set(name: str, value):
    def edit(tensors):
        tensors[name] = value(tensors[name]) if callable(value) else value
    return edit


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("ct-FP8_DYNAMIC-qwen2", _set(f"{Q}.weight_scale", lambda s: s[:-1]), f"{Q}.weight_scale: scale shape"),
    ("ct-FP8_DYNAMIC-qwen2", _set(f"{Q}.weight_scale", lambda s: s.index_fill(0, torch.tensor([3]), float("nan"))),
     f"tensor {Q}.weight_scale holds NaN"),
    ("ct-FP8-static-llama", _set(f"{Q}.input_scale", torch.tensor([-1.0])), f"{Q}.input_scale: .*not positive"),
    ("block-fp8-llama", _set(f"{Q}.weight_scale_inv", lambda s: s[:, :1]), f"{Q}.weight_scale_inv: scale shape"),
    ("block-fp8-llama", _set(f"{Q}.weight", lambda w: w.view(torch.uint8).index_fill(1, torch.tensor([5]), 0x7F)
                             .view(torch.float8_e4m3fn)), f"tensor {Q}.weight holds NaN"),
    ("block-fp8-llama", lambda tensors: tensors.pop(f"{Q}.weight_scale_inv"),
     "missing weights: model.layers.0.self_attn.qkv_proj.weight_scale \\(q\\)"),
    ("ct-FP8_DYNAMIC-qwen3_moe", _set("model.layers.1.mlp.experts.3.up_proj.weight_scale", lambda s: s * float("inf")),
     "experts.3.up_proj.weight_scale holds NaN or infinite"),
])
def test_bad_scales_are_refused_naming_the_tensor(checkpoints, tmp_path, name, edit, message):
    broken = edited_checkpoint(checkpoints[name][0], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        load_model(broken, torch.float32, "cpu")


def test_fp8_data_in_a_layer_the_config_leaves_unquantized_is_refused(checkpoints, tmp_path):
    quantized = checkpoints["ct-FP8_DYNAMIC-qwen2"][0]
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:.*layers\\.1\\.mlp\\.down_proj$")
    (tmp_path / "edited").mkdir()
    for path in quantized.iterdir():
        (tmp_path / "edited" / path.name).write_bytes(path.read_bytes())
    (tmp_path / "edited" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="down_proj.weight: is FP8 but this layer is not quantized"):
        load_model(tmp_path / "edited", torch.float32, "cpu")


def test_a_checkpoints_fp8_kv_scales_load_and_go_unused(checkpoints, tmp_path):
    """An FP8 ``kv_cache_scheme`` and its per-tensor ``k_scale``/``v_scale`` load; the FP8 KV cache keeps its own
    scales per token and head, so the tokens are those of the checkpoint without them."""
    quantized = checkpoints["ct-FP8_DYNAMIC-qwen2"][0]
    layers = json.loads((quantized / "config.json").read_text())["num_hidden_layers"]

    def add_kv_scales(tensors):
        for layer in range(layers):
            for name in ("k_scale", "v_scale"):
                tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([0.05])

    with_scales = edited_checkpoint(quantized, tmp_path / "edited", add_kv_scales)
    config = json.loads((with_scales / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (with_scales / "config.json").write_text(json.dumps(config))
    assert _generate(with_scales, kv_cache_dtype="fp8")[2] == _generate(quantized, kv_cache_dtype="fp8")[2]
    config["quantization_config"]["kv_cache_scheme"]["type"] = "int"
    (with_scales / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unsupported kv_cache_scheme \\(INT8\\)"):
        load_model(with_scales, torch.float32, "cpu")
