"""``Tokenizer.from_pretrained`` loads the tokenizer ``AutoTokenizer`` loads, without ``AutoTokenizer`` where the
files settle its class: the same class, token ids, texts and chat template, and in a fresh process without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers.models.auto import tokenization_auto

from megatron_serve import tokenizer as tokenizer_module
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "a . b , c ! d ? e 's f n't g", ""]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen2_vl"])
def model_dir(request, tmp_path_factory) -> Path:
    return Path(make_tiny_model(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param))


def test_overridden_model_types_are_transformers_own():
    """The model types for which ``AutoTokenizer`` replaces a generic class named by the file with one of its own,
    as the installed ``transformers`` decides them (a new version that adds one fails here, not in a server)."""
    names = tokenization_auto.TOKENIZER_MAPPING_NAMES
    generic = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizer", "MistralCommonBackend"}
    overridden = {t for t in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
                  if names.get(t) and names[t].removesuffix("Fast") not in generic}
    mistral = {t for t, name in names.items() if name and name.removesuffix("Fast") == "MistralCommonBackend"}
    assert tokenizer_module._AUTO_OVERRIDDEN_TYPES == overridden | mistral


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(model_dir):
    ours = Tokenizer.from_pretrained(model_dir)
    auto = Tokenizer(transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True), [])
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    overridden = model_type in tokenizer_module._AUTO_OVERRIDDEN_TYPES
    assert tokenizer_module._auto_picks_backend(model_dir) == (not overridden)
    assert type(ours.hf_tokenizer) is type(auto.hf_tokenizer)
    assert ours.vocab_size == auto.vocab_size and ours.special_token_ids == auto.special_token_ids
    assert ours.hf_tokenizer.eos_token_id == auto.hf_tokenizer.eos_token_id
    assert ours.grammar_json() == auto.grammar_json()
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special) == \
                auto.hf_tokenizer.encode(text, add_special_tokens=special), text
            assert ours.hf_tokenizer(text, add_special_tokens=special)["input_ids"] == \
                auto.hf_tokenizer(text, add_special_tokens=special)["input_ids"]
            assert ours.decode(ids, skip_special_tokens=special) == auto.decode(ids, skip_special_tokens=special)
            assert ours.hf_tokenizer.decode(ids, skip_special_tokens=special) == \
                auto.hf_tokenizer.decode(ids, skip_special_tokens=special)
    for prompt in (True, False):
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=prompt) == \
            auto.apply_chat_template(CONVERSATION, add_generation_prompt=prompt)


def test_a_generic_tokenizer_loads_without_torch(model_dir):
    """What the server process gains: no torch, no ``AutoConfig`` (the model type decides which path is taken)."""
    if "vision_config" in json.loads((model_dir / "config.json").read_text()):
        pytest.skip("a vision-language model's image processor imports torch")
    code = ("import sys; from megatron_serve.tokenizer import Tokenizer; "
            f"Tokenizer.from_pretrained({str(model_dir)!r}); "
            "print(sorted({'torch', 'transformers.configuration_utils'} & set(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    if tokenizer_module._auto_picks_backend(model_dir):
        assert loaded == "[]"
    else:
        assert "transformers.configuration_utils" in loaded


def test_a_file_naming_remote_code_goes_through_auto_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = {"tokenizer_class": "TokenizersBackend", "auto_map": {"AutoTokenizer": [None, "x.Y"]}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not tokenizer_module._auto_picks_backend(tmp_path)
    config.pop("auto_map")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_module._auto_picks_backend(tmp_path)
    config["tokenizer_class"] = "GPT2Tokenizer"  # a class of its own: AutoTokenizer resolves it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not tokenizer_module._auto_picks_backend(tmp_path)


@pytest.mark.parametrize("model_type", ["gemma", "mistral"])
def test_a_file_naming_pretrained_tokenizer_fast_loads_as_auto_tokenizer_does(tmp_path, model_type):
    """``PreTrainedTokenizerFast`` is ``TokenizersBackend`` to ``AutoTokenizer``, also for a model type that
    ``transformers`` registers a class of its own for (Gemma's) but that it does not override."""
    source = Path(make_tiny_model(tmp_path / "tiny", seed=0))
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        data = json.loads((source / name).read_text())
        data.update({"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"},
                     "config.json": {"model_type": model_type}}.get(name, {}))
        (tmp_path / name).write_text(json.dumps(data))
    ours = Tokenizer.from_pretrained(tmp_path).hf_tokenizer
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert tokenizer_module._auto_picks_backend(tmp_path) and type(ours) is type(auto)
    assert [ours(text)["input_ids"] for text in TEXTS] == [auto(text)["input_ids"] for text in TEXTS]
