"""LoRA adapters under ``--batch-invariant`` with expert parallelism over 2 tensor-parallel ranks (real processes over
gloo) give one rank's bits: the row-parallel layers gather their input with adapters too, and every adapter's delta is
computed whole as one rank computes it (``InferenceConfig.gathers_rows``, ``model.lora.shards``). A mixed batch of
expert, dense, attention and base rows (Qwen2-MoE: a sparse layer between two dense ones, a shared expert): tokens
and log probs ``==`` one rank's. The control runs the same group with the row-parallel layers adding the ranks'
partial sums, the adapters' row-parallel deltas joining them (``data_parallel_engine.py``'s ``PARTIAL_SUMS``, which
each rank's process installs): its log probs differ from one rank's. In one process, each rank's column-parallel
projections with adapter rows give one rank's columns."""

from __future__ import annotations

import pytest
import torch

from megatron_serve import SamplingParams
from megatron_serve.model.loader import load_model
from megatron_serve.model.lora.checkpoint import read_adapter
from megatron_serve.model.lora.slots import LoraSlots
from megatron_serve.model.parallel import TensorParallel
from megatron_serve.wire.request import DynamicInferenceRequest

from ..prompts import PROMPTS
from .data_parallel_runs import Case, Launcher, Request, serve_cases
from .test_lora_tensor_parallel import MOE_JOBS, moe_adapters, moe_base  # noqa: F401 - fixtures


#: ``MOE_JOBS`` (expert, dense, attention+expert and base rows), and the base on the two prompts it has no base row of
JOBS = MOE_JOBS + [(PROMPTS[2], None), (PROMPTS[3], None)]


def _case(name: str, model_dir: str, adapters: dict[str, str], partial_sums: bool = False) -> Case:
    """``JOBS`` in one batch, greedy, in float32 ``--batch-invariant`` with every adapter loaded."""
    requests = [Request(f"r{i}", prompt, SamplingParams(temperature=0.0, num_tokens_to_generate=10, ignore_eos=True,
                                                        return_log_probs=True, lora_name=adapter))
                for i, (prompt, adapter) in enumerate(JOBS)]
    config = dict(dtype="float32", batch_invariant=True, enable_lora=True, max_loras=3, max_lora_rank=8,
                  lora_modules=adapters)
    return Case(name, model_dir, [[requests]], config, partial_sums=partial_sums)


def _rows(requests: list[DynamicInferenceRequest]) -> list[tuple[list[int], list[float]]]:
    return [(r.generated_tokens, r.generated_log_probs) for r in requests]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_adapters_under_expert_parallelism_over_tensor_parallel_ranks_are_one_rank_bitwise(
        moe_base, moe_adapters, tmp_path):  # noqa: F811 - fixtures
    with Launcher() as launcher:  # both groups forked from one process: its start, importing torch, costs some 3 CPU-s
        one = _rows(serve_cases(tmp_path / "one", [_case("gathered", moe_base, moe_adapters)],
                                launcher=launcher)["gathered"][0][0])
        served = serve_cases(tmp_path / "ep", [_case("gathered", moe_base, moe_adapters),
                                               _case("partial_sums", moe_base, moe_adapters, partial_sums=True)], tp=2,
                             launcher=launcher)
    assert _rows(served["gathered"][0][0]) == one
    partial_sums = _rows(served["partial_sums"][0][0])
    assert [tokens for tokens, _ in partial_sums] == [tokens for tokens, _ in one]
    assert [log_probs for _, log_probs in partial_sums] != [log_probs for _, log_probs in one], \
        "the control (partial sums in the row-parallel layers) gives one rank's log probs too: the equality proves nothing"
    # control: each adapter changes its prompt's tokens (against the same prompt on the base), so the equality covers
    # the expert, dense and attention deltas
    assert all(one[adapted][0] != one[base][0] for adapted, base in ((0, 4), (5, 1), (2, 6), (3, 7)))


def test_column_parallel_deltas_are_one_ranks_columns(moe_base, moe_adapters):  # noqa: F811 - fixtures
    """Each rank's column-parallel projections (q|k|v, gate|up: no collective, so both ranks run in this process)
    with the dense adapter's rows among base rows give one rank's columns, ``==``: the rank keeps ``B`` whole and adds
    its columns of the whole delta. (Cutting ``B``'s rows instead rounds k and v, 16 columns a rank, otherwise on an
    AVX-512 CPU in float32; the engine test above holds the whole group with its control.)"""
    def projections(tp: TensorParallel) -> dict[str, torch.nn.Module]:
        model = load_model(moe_base, torch.float32, "cpu", tp)
        model.use_batch_invariant_ops()
        slots = LoraSlots(model, 2, 8, batch_invariant=True)
        slots.write(1, read_adapter("dense", moe_adapters["dense"], model.config, 8))
        indices = torch.tensor([1, -1, 1, 1, -1, 1, 1])
        slots.rows.set(indices, indices.numpy())
        return {f"{layer}.{path}": model.model.layers[layer].get_submodule(path)
                for layer in (0, 2) for path in ("self_attn.qkv_proj", "mlp.gate_up_proj")}

    one = projections(TensorParallel())
    for rank in range(2):
        for name, split in projections(TensorParallel(rank, 2, expert_parallel=True, gathered_rows=True)).items():
            whole = one[name]
            x = torch.randn(7, whole.weight.shape[1], generator=torch.Generator().manual_seed(0))
            expected = whole(x)
            columns = [expected[:, whole.slices[part][0] + start : whole.slices[part][0] + start + length]
                       for part, (_offset, start, length) in split.slices.items()]
            assert torch.equal(split(x), torch.cat(columns, dim=-1)), (rank, name)
