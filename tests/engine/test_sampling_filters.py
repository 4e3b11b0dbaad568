"""The sampling table's ``FILTER`` rows and their ops (``engine/sampling/filters.py``): every row has exactly one op,
and ``typical_p``, added as a row and an op alone, processes logits exactly as transformers' own
``TypicalLogitsWarper`` (after its ``TemperatureLogitsWarper``), bit for bit, in a step shared with a row that does not
use it (left as it is) and in the parity checker's lone-row replay."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TypicalLogitsWarper

from megatron_serve.engine.sampling.filters import FILTER_OPS, filtered_logits, FilterRows
from megatron_serve.engine.sampling.sampler import Sampler
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.wire.sampling_fields import FILTERS
from megatron_serve.wire.sampling_params import SamplingParamError, SamplingParams

VOCAB = 96


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _transformers(logits: torch.Tensor, temperature: float, mass: float) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    return TypicalLogitsWarper(mass)(None, scores)


def _step(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows through the filters as a step reads them from their slots."""
    state = SamplingState(VOCAB, torch.device("cpu"), capacity=len(params))
    keys = [str(i) for i in range(len(params))]
    for key, row_params in zip(keys, params):
        state.add(key, row_params, seed=1, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    rows = state.rows(keys, [0] * len(keys), [0] * len(keys))
    return filtered_logits(logits, FilterRows(lambda name: state.vector(name)[rows.slot], rows.inputs,
                                              rows.max_top_k))


def test_every_filter_row_of_the_table_has_exactly_one_op():
    inputs = [name for names, _ in FILTER_OPS for name in names]
    assert sorted(inputs) == sorted(row.sampler for row in FILTERS)  # no row without an op, none twice


@pytest.mark.parametrize(("temperature", "mass"), [(1.0, 0.9), (0.7, 0.5), (1.3, 0.2), (1.0, 1e-6)])
def test_typical_p_in_a_step_is_transformers_warper_bit_for_bit(temperature, mass):
    logits = _logits(3, seed=int(mass * 1000))
    out = _step(logits, [SamplingParams(temperature=temperature, typical_p=mass), SamplingParams(temperature=0.8),
                         SamplingParams(temperature=temperature, typical_p=mass)])
    for row in (0, 2):
        expected = _transformers(logits[row: row + 1], temperature, mass)
        assert torch.equal(out[row: row + 1], expected), (row, temperature, mass)
        assert torch.isneginf(expected).any()  # the warper dropped tokens: the comparison means something
    assert torch.equal(out[1], logits[1] / torch.tensor(0.8))  # the row without typical_p: its temperature only


def test_the_parity_checkers_lone_row_replay_is_the_same_op():
    logits = _logits(4, seed=3)
    params = SamplingParams(temperature=0.9, typical_p=0.6)
    assert torch.equal(Sampler.processed_alone(logits, params), _transformers(logits, 0.9, 0.6))
    assert torch.equal(Sampler.processed_alone(logits, params), _step(logits, [params] * 4))


def test_without_typical_p_nothing_is_dropped():
    """The control: the same rows at the neutral ``typical_p`` (1) keep every token, where the warper drops some."""
    logits = _logits(2, seed=5)
    out = _step(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, typical_p=1.0)])
    assert out is logits  # no filter ran
    assert not torch.equal(_transformers(logits, 1.0, 0.5), logits)
    mixed = _step(logits, [SamplingParams(typical_p=0.5), SamplingParams(typical_p=1.0)])
    assert torch.equal(mixed[1], logits[1]) and not torch.equal(mixed[0], logits[0])


def test_typical_p_outside_its_range_is_refused_by_name():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(SamplingParamError, match="^typical_p "):
            SamplingParams(typical_p=bad)
