"""The engine's ``--batch-invariant`` steps through the GPU attention kernel, on CPU under the Triton interpreter.

On CUDA ``PagedAttention.attend`` hands the mode's rows to ``triton_invariant_attention.attend_step``; here the
CPU mode's attention is replaced by that call, so the kernel meets the engine's real step metadata (decode
rows and prefill chunks in one step, 16-token chunks, a prefix-cache hit) and the target request
must still get the same tokens and log probs, ``==``, whatever runs beside it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton: CPU tensors go through the interpreter (a GPU runs natively)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_kernels import triton_invariant_attention  # noqa: E402
from megatron_kernels.paged_kv import PagedKV  # noqa: E402
from megatron_serve.model.attention import PagedAttention  # noqa: E402
from megatron_serve.model.tiny import make_tiny_model  # noqa: E402

from ..triton_interpreter import install  # noqa: E402
from .runs import Setup, differing, run_target  # noqa: E402

install()  # the kernel's tl.sum and tl.max without a language re-patch per call


def _kernel_attention(self: PagedAttention, q: torch.Tensor, context, cache: PagedKV) -> torch.Tensor:
    return triton_invariant_attention.attend_step(q, context.metadata, cache, self.scale, torch.empty_like(q))


@pytest.fixture
def kernel_attention(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the engine runs the kernel itself (tests/invariance/test_invariant_cuda_graphs.py)")
    if type(triton_invariant_attention._invariant_attention_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process")
    monkeypatch.setattr(PagedAttention, "_attend_invariant", _kernel_attention)


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory) -> str:
    """The folder's tiny Llama (seed 0) with one layer: every layer's launch meets the same step metadata, and the
    interpreter runs a launch program by program (one per row and head): a second layer doubled its CPU."""
    return str(make_tiny_model(tmp_path_factory.mktemp("triton-attention") / "llama", seed=0, arch="llama",
                               num_layers=1))


def test_the_target_is_bitwise_the_same_in_every_batch_through_the_kernel(one_layer_llama, kernel_attention):
    calls = []
    original = triton_invariant_attention.attend_step
    triton_invariant_attention.attend_step = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        alone = run_target(one_layer_llama, "float32", True, Setup())
    finally:
        triton_invariant_attention.attend_step = original
    assert calls, "the kernel did not run"
    for setup in (Setup(others=3, max_batch_tokens=16), Setup(prefix_hit=True)):
        run = run_target(one_layer_llama, "float32", True, setup)
        assert (run.tokens, run.log_probs) == (alone.tokens, alone.log_probs), \
            f"{setup.describe()}: {differing(run.log_probs, alone.log_probs)} log probs differ"
