"""An engine process reads its vocabulary without ``transformers`` (``TokenizerFiles``): the same EOS ids and the
same grammar vocabulary as the whole tokenizer, added tokens of ``tokenizer_config.json`` included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import llguidance
import llguidance.hf
import pytest

from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer, TokenizerFiles


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2_vl"])
def model_dir(request, tmp_path_factory) -> Path:
    return Path(make_tiny_model(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param))


def grammar_views(directory: Path) -> tuple[llguidance.LLTokenizer, llguidance.LLTokenizer]:
    """llguidance's view from the engine's vocabulary, and the one ``llguidance.hf`` makes of the whole tokenizer."""
    whole, files = Tokenizer.from_pretrained(directory), TokenizerFiles.from_dir(directory)
    ours = llguidance.LLTokenizer(files.grammar_json(), n_vocab=whole.vocab_size, eos_token=files.eos_token_ids)
    theirs = llguidance.hf.from_tokenizer(whole.hf_tokenizer, n_vocab=whole.vocab_size, eos_token=whole.eos_token_ids)
    return ours, theirs


def assert_same_view(ours: llguidance.LLTokenizer, theirs: llguidance.LLTokenizer) -> None:
    assert ours.vocab_size == theirs.vocab_size and ours.eos_tokens == theirs.eos_tokens
    for token in range(theirs.vocab_size):
        assert ours.decode_bytes([token]) == theirs.decode_bytes([token]), token
        assert ours.is_special_token(token) == theirs.is_special_token(token), token


def test_the_engines_vocabulary_is_the_whole_tokenizers(model_dir):
    files, whole = TokenizerFiles.from_dir(model_dir), Tokenizer.from_pretrained(model_dir)
    assert isinstance(files, TokenizerFiles)
    assert files.eos_token_ids == whole.eos_token_ids
    assert (files.images is None) == (whole.images is None)
    assert_same_view(*grammar_views(model_dir))


def test_added_tokens_that_only_tokenizer_config_declares_are_added(tmp_path):
    directory = Path(make_tiny_model(tmp_path / "m", seed=0, arch="llama"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    vocab = json.loads((directory / "tokenizer.json").read_text())
    next_id = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])]) + 1
    declared = config.setdefault("added_tokens_decoder", {})
    declared[str(next_id)] = {"content": "<|tool_call|>", "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}
    declared[str(next_id + 1)] = {"content": "plainword", "lstrip": False, "normalized": True, "rstrip": False,
                                  "single_word": False, "special": False}
    config_path.write_text(json.dumps(config))
    ours, theirs = grammar_views(directory)
    assert theirs.decode_bytes([next_id]) == b"<|tool_call|>"  # transformers added it: the case is real
    assert_same_view(ours, theirs)
    # the control: tokenizer.json alone lacks them
    bare = llguidance.LLTokenizer((directory / "tokenizer.json").read_text(), n_vocab=theirs.vocab_size)
    assert bare.decode_bytes([next_id]) != theirs.decode_bytes([next_id])


ENGINE = """
import sys
from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.wire.sampling_params import StructuredOutputsParams
engine = DynamicInferenceEngine.from_model_dir(sys.argv[1], InferenceConfig(), vocabulary_only=True)
request = DynamicInferenceRequest("r", None, [5, 6, 7], SamplingParams(
    temperature=0.0, num_tokens_to_generate=8, structured_outputs=StructuredOutputsParams(regex="[ab]+")))
engine.add_request(request)
while engine.has_unfinished_requests():
    engine.step()
print(request.generated_tokens, "transformers" in sys.modules)
"""


def test_an_engine_of_its_vocabulary_alone_follows_a_grammar_without_importing_transformers(tmp_path):
    directory = make_tiny_model(tmp_path / "m", seed=0, arch="llama")
    done = subprocess.run([sys.executable, "-c", ENGINE, str(directory)], capture_output=True, text=True, timeout=300,
                          check=True)
    tokens, imported = done.stdout.split("]")
    whole = Tokenizer.from_pretrained(directory)
    text = whole.decode(json.loads(tokens + "]"), skip_special_tokens=True)
    assert text and set(text) <= {"a", "b"}, text
    assert imported.strip() == "False"
