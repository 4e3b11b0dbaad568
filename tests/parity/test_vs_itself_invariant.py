"""The engine-against-itself search with ``batch_invariant=True`` on both sides: zero log-prob error.

Each row of ``settings.py`` whose two setups compute the same bits in the mode runs its case with the mode on under
setups A and B; every request must come back identical: tokens, log probs, prompt log probs, top log probs and
expert routing, with ``==``. Vision models are left out (the mode serves text models).

Which rows are bitwise: every one but those with tensor parallelism's partial sums (TP=1 vs TP=2, and TP=2 vs EP=2,
whose TP side slices each expert). Expert parallelism over the TP ranks against one rank is bitwise (the MoE layers
combine in ascending expert order, attention's and the dense layers' row-parallel projections gather their input),
but only where this CPU's GEMMs compute a slice of the output columns as the whole GEMM computes them: the engine's
probe (``LlamaForCausalLM.column_split_problems``) says, and a model it fails for goes on to the next row (on an AMD
EPYC float32 slices narrower than 16 columns round otherwise). Data-parallel attention at TP 1 and pipeline
micro-batches are bitwise everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from megatron_serve import DynamicInferenceRequest
from megatron_serve.model.config import ModelConfig
from megatron_serve.model.loader import build_model
from megatron_serve.model.parallel import TensorParallel

from .cases import Sampling, draw_case
from .conftest import INVARIANT_SHARE
from .engine_runs import Placement, Setup, run_case
from .models import LoadedModel
from .settings import SETTINGS, Setting, setting_for

SKIPPED_ROWS = ("TP=1 vs TP=2", "TP=2 vs EP=2 (experts over the ranks)")  # TP's partial sums: not one rank's bits
SPLIT_ROWS = ("one rank vs EP=2 over the TP ranks",)  # bitwise where this CPU's column slices are (column_splits_hold)


@functools.cache
def column_splits_hold(model_dir: str, dtype: torch.dtype, device: str) -> bool:
    """Whether rank 0 of 2 expert-parallel ranks computes its column slices as one rank computes the whole columns,
    on this machine (the engine's own probe; a GPU's Triton GEMMs always do)."""
    tp = TensorParallel(0, 2, expert_parallel=True, gathered_rows=True)
    return not build_model(ModelConfig.from_dir(model_dir), dtype, device, tp).column_split_problems()


def bitwise_here(name: str, model: LoadedModel, placement: Placement) -> bool:
    if name in SKIPPED_ROWS:
        return False
    if name in SPLIT_ROWS:
        here = placement.for_config(SETTINGS[name].b.config)
        return column_splits_hold(str(model.directory), here.dtype, here.device)
    return True


def _invariant(setup: Setup) -> Setup:
    return dataclasses.replace(setup, config={**setup.config, "batch_invariant": True})


def identical(name: str, a: DynamicInferenceRequest, b: DynamicInferenceRequest) -> str | None:
    for field in ("generated_tokens", "generated_log_probs", "prompt_log_probs", "generated_top_n_logprobs",
                  "finish_reason"):
        if getattr(a, field) != getattr(b, field):
            return f"{name}: {field} differ under A and B"
    if (a.routing_indices is None) != (b.routing_indices is None) or (
            a.routing_indices is not None and a.routing_indices.tolist() != b.routing_indices.tolist()):
        return f"{name}: the routing differs under A and B"
    return None


def test_engine_equals_itself_bitwise_in_the_batch_invariant_mode(invariant_case_seed, parity, search_case):
    with search_case("engine against itself, batch-invariant", invariant_case_seed) as scope:
        model = scope.model
        if model.spec.vision:
            pytest.skip("vision models are not served in the batch-invariant mode")
        # every INVARIANT_SHARE-th case runs here: walk the rows by that count, or only every INVARIANT_SHARE-th row
        # of the schedule would ever come up
        position = invariant_case_seed // INVARIANT_SHARE
        name = next(row for row in (setting_for(position + k, model.spec) for k in itertools.count())
                    if bitwise_here(row, model, parity.placement))
        scope.tally.settings[name] = scope.tally.settings.get(name, 0) + 1
        setting: Setting = SETTINGS[name]
        scope.parts.insert(0, f"setting {name!r} (batch-invariant)")
        case = draw_case(invariant_case_seed, model, Sampling.SEEDED, tensor_parallel=False)
        scope.parts.append(case.describe())
        a, b = _invariant(setting.a), _invariant(setting.b)
        placement = parity.placement.for_config(a.config_for(case)).for_config(b.config_for(case))
        results_a = run_case(case, model, a, placement)
        counters: dict[str, int] = {}
        results_b = run_case(case, model, b, placement, counters)
        scope.tally.accepted_drafts += counters.get("spec_decode_num_accepted_tokens", 0)
        for draw in case.requests:
            scope.tally.observe(results_b[draw.name])
            scope.tally.tokens += len(results_b[draw.name].generated_tokens)
        problems = [identical(draw.name, results_a[draw.name], results_b[draw.name]) for draw in case.requests]
        problems = [p for p in problems if p]
        assert not problems, "\n".join(problems)
