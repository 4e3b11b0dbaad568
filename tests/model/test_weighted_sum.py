"""The ordered combine of expert outputs (``--batch-invariant``): a token's rows added one after another, in the
order given, each rounded to the model dtype: the same bits on a CPU and a GPU, whatever the other tokens are.

On a CPU one ``index_add_`` of every row adds them in that order (the reference here); on a GPU its atomic adds
take them in any order, which the MoE cases of the parity search met on an H200 (the GPU test below compares the
device's result with the CPU's, bit for bit)."""

from __future__ import annotations

import pytest
import torch

from megatron_serve.model.experts.token_dispatcher import weighted_sum


def rows(seed: int, counts: list[int], hidden: int = 48) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows grouped by token (``counts[t]`` rows for token t), their weights and tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    outputs = torch.randn(len(tokens), hidden, generator=generator).to(torch.bfloat16)
    weights = torch.rand(len(tokens), generator=generator).to(torch.bfloat16)
    return outputs, weights, tokens


def one_after_another(outputs: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_tokens: int
                      ) -> torch.Tensor:
    total = outputs.new_zeros((num_tokens, outputs.shape[1]))
    for row, token in enumerate(tokens.tolist()):
        total[token] = total[token] + (outputs[row] * weights[row]).to(outputs.dtype)
    return total


@pytest.mark.parametrize("counts", [[2, 2, 2], [4, 1, 0, 3, 4], [1] * 7])
def test_the_ordered_sum_adds_a_tokens_rows_one_after_another(counts):
    outputs, weights, tokens = rows(0, counts)
    got = weighted_sum(outputs, weights, tokens, len(counts), True, 4)
    assert torch.equal(got, one_after_another(outputs, weights, tokens, len(counts)))
    # the control: in another order the bits differ (bfloat16 addition is not associative)
    flipped = torch.cat([torch.arange(len(tokens))[tokens == t].flip(0) for t in range(len(counts))])
    if max(counts) >= 3:
        assert not torch.equal(got, one_after_another(outputs[flipped], weights[flipped], tokens, len(counts)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the atomic adds are a GPU's "
                    "(benchmarks/gpu_session.sh invariant runs this file)")
def test_a_gpu_adds_them_in_the_same_order_as_a_cpu():
    counts = [4] * 4096  # many rows of each token at once: where atomic adds race
    outputs, weights, tokens = rows(1, counts, hidden=256)
    cpu = weighted_sum(outputs, weights, tokens, len(counts), True, 4)
    for _ in range(3):
        gpu = weighted_sum(outputs.cuda(), weights.cuda(), tokens.cuda(), len(counts), True, 4)
        assert torch.equal(gpu.cpu(), cpu)
