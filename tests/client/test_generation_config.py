"""The model's ``generation_config.json`` as sampling defaults: read, checked, and applied by the Python API."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_serve import MegatronLLM
from megatron_serve.generation_config import GenerationDefaults
from megatron_serve.wire.sampling_params import SamplingParams

QWEN3 = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.6, "top_k": 20,
         "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.05, "max_new_tokens": 5,
         "transformers_version": "4.51.0"}


def write(folder, data) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))


def test_auto_reads_the_sampling_keys_vllm_reads(tmp_path):
    write(tmp_path, QWEN3)
    defaults = GenerationDefaults.load("auto", tmp_path)
    assert dict(defaults.values) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "num_tokens_to_generate": 5,
                                     "min_p": 0.0, "repetition_penalty": 1.05}
    assert defaults.source == tmp_path / "generation_config.json"
    assert "temperature=0.6" in defaults.describe()
    assert GenerationDefaults.load(None, tmp_path) == defaults  # auto is the default


def test_none_ignores_the_file_and_a_directory_replaces_it(tmp_path):
    write(tmp_path / "model", QWEN3)
    write(tmp_path / "other", {"temperature": 0.2})
    for setting in ("none", "vllm", "NONE"):
        assert dict(GenerationDefaults.load(setting, tmp_path / "model").values) == {}
    assert dict(GenerationDefaults.load(str(tmp_path / "other"), tmp_path / "model").values) == {"temperature": 0.2}
    assert dict(GenerationDefaults.load("auto", tmp_path / "no-file").values) == {}
    with pytest.raises(FileNotFoundError, match="--generation-config"):
        GenerationDefaults.load(str(tmp_path / "missing"), tmp_path / "model")


def test_an_unusable_file_fails_naming_it(tmp_path):
    write(tmp_path / "a", {"temperature": -1})
    with pytest.raises(ValueError, match="temperature") as bad:
        GenerationDefaults.load("auto", tmp_path / "a")
    assert "generation_config.json" in str(bad.value) and "--generation-config none" in str(bad.value)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        GenerationDefaults.load("auto", tmp_path / "b")


def test_explicit_values_win_over_the_defaults():
    defaults = GenerationDefaults({"temperature": 0.6, "top_k": 20})
    params = defaults.sampling_params(temperature=0.0, top_k=None, top_p=0.5)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 20, 0.5)
    assert GenerationDefaults().sampling_params() == SamplingParams()


def test_megatron_llm_applies_them_when_generate_gets_no_sampling_params(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    write(model, {"temperature": 0.0, "top_k": 7, "max_new_tokens": 3})
    llm = MegatronLLM(str(model))
    out = llm.generate("Hello")[0]
    assert (out.sampling_params.temperature, out.sampling_params.top_k) == (0.0, 7)
    assert out.sampling_params.num_tokens_to_generate == 3 and len(out.generated_tokens) <= 3
    given = llm.generate("Hello", SamplingParams(temperature=0.5, num_tokens_to_generate=2))[0]
    assert (given.sampling_params.temperature, given.sampling_params.top_k) == (0.5, 0)  # given: used as is
    ignored = MegatronLLM(str(model), generation_config="none").generate("Hello")[0].sampling_params
    assert (ignored.temperature, ignored.top_k, ignored.num_tokens_to_generate) == (1.0, 0, 16)  # SamplingParams()
