"""vLLM's ``allowed_token_ids``, added as the sampling table's row and its op (the control row's bias): only the
listed tokens keep their logits, in a step shared with a request that lists none (whose logits stay as they are)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from megatron_serve.engine.sampling.logits_processors import apply_controls
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.wire.sampling_params import SamplingParamError, SamplingParams, params_from_wire

VOCAB = 16


def _controlled(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    state = SamplingState(VOCAB, torch.device("cpu"), capacity=2)
    state.add("a", params, seed=1, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    state.add("b", SamplingParams(temperature=0.0), seed=1, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    return logits, apply_controls(logits, state, state.rows(["a", "b"], [0, 0], [0, 0]))


def test_only_the_allowed_tokens_keep_their_logits_and_the_other_row_is_untouched():
    logits, out = _controlled(SamplingParams(temperature=0.0, allowed_token_ids=[3, 7]))
    assert torch.equal(out[0, [3, 7]], logits[0, [3, 7]])
    assert torch.isneginf(out[0]).sum().item() == VOCAB - 2
    assert int(out[0].argmax()) in (3, 7)
    assert torch.equal(out[1], logits[1])  # the neutral row, bit for bit


def test_without_the_parameter_no_token_is_masked():
    """The control: the same step without ``allowed_token_ids`` masks nothing."""
    logits, out = _controlled(SamplingParams(temperature=0.0))
    assert torch.equal(out, logits)


def test_the_parameter_travels_on_the_wire_and_bad_values_are_refused_by_name():
    params = SamplingParams(allowed_token_ids=(3, 7))
    assert params.allowed_token_ids == [3, 7] and params.has_logits_controls
    assert params_from_wire(msgspec.msgpack.encode(params))[0] == params
    assert b"allowed_token_ids" not in msgspec.msgpack.encode(SamplingParams())  # the default stays off the wire
    for bad in ([], [-1], "3", [1.5]):
        with pytest.raises(SamplingParamError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
