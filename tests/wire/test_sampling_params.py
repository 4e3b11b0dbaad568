"""Bad sampling values are refused with a message naming the field, and a typed error that names it as data."""

from __future__ import annotations

import pytest

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.wire.sampling_params import (
    MalformedSamplingParams,
    SamplingParamError,
    UnknownSamplingParams,
    params_from_wire,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"num_tokens_to_generate": 0}, "num_tokens_to_generate"),
        ({"stop_words": "stop"}, "stop_words"),
        ({"stop_words": [""]}, "stop_words"),
        ({"termination_id": -1}, "termination_id"),
        ({"top_n_logprobs": 100}, "top_n_logprobs"),
        ({"seed": "x"}, "seed"),
        ({"ignore_eos": True, "termination_id": 3}, "termination_id"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamError, match=field) as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field and str(caught.value).startswith(field)


def test_every_path_in_raises_the_typed_error_whose_field_a_front_end_renames():
    """Keywords, dicts and wire bytes all end in a ``SamplingParamError``: the HTTP layer renames the field by
    ``field`` and ``naming`` (``num_tokens_to_generate`` -> ``max_tokens``), never by reading the message."""
    import msgspec

    with pytest.raises(SamplingParamError) as by_keyword:
        SamplingParams(num_tokens_to_generate=0)
    with pytest.raises(SamplingParamError) as by_dict:
        SamplingParams.from_dict({"num_tokens_to_generate": 0})
    with pytest.raises(SamplingParamError) as by_wire:
        params_from_wire(msgspec.msgpack.encode({"num_tokens_to_generate": 0}))
    for caught in (by_keyword, by_dict, by_wire):
        assert caught.value.field == "num_tokens_to_generate"
        assert caught.value.naming("max_tokens") == "max_tokens must be >= 1, got 0"
    with pytest.raises(SamplingParamError, match="logit_bias token id must be >= 0") as bias:
        SamplingParams(logit_bias={-1: 1.0})
    assert bias.value.field == "logit_bias"
    with pytest.raises(UnknownSamplingParams) as unknown:
        params_from_wire(msgspec.msgpack.encode({"temprature": 0.5, "top_k": 2}))
    assert unknown.value.names == ["temprature"]
    with pytest.raises(UnknownSamplingParams):
        SamplingParams(temprature=0.5)
    with pytest.raises(MalformedSamplingParams, match="top_k"):  # the decoder's words; its path names the field
        params_from_wire(msgspec.msgpack.encode({"top_k": "two"}))


def test_unknown_fields_from_the_wire_are_refused():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    assert SamplingParams.from_dict({"top_k": 3}).top_k == 3


def test_inference_config_validation():
    with pytest.raises(ValueError, match="dtype"):
        InferenceConfig(dtype="int8")
    with pytest.raises(ValueError, match="max_batch_tokens"):
        InferenceConfig(max_batch_tokens=0)
    assert InferenceConfig(dtype="bfloat16").to_dict()["dtype"] == "bfloat16"


def test_shared_params_read_each_distinct_set_once_and_never_keep_bad_bytes():
    import msgspec

    from megatron_serve.wire.sampling_params import SharedParams

    shared = SharedParams(size=2)
    greedy = msgspec.msgpack.encode({"temperature": 0.0, "num_tokens_to_generate": 4})
    first, wire = shared.read(greedy)
    assert (first.temperature, first.num_tokens_to_generate, wire) == (0.0, 4, greedy)
    assert shared.read(greedy)[0] is first  # decoded and checked once, then shared
    assert shared.read(b"")[0] == SamplingParams()
    bad = msgspec.msgpack.encode({"top_k": -3})
    for _ in range(2):  # refused every time: a refusal is never remembered as parameters
        with pytest.raises(ValueError, match="top_k"):
            shared.read(bad)
    shared.read(msgspec.msgpack.encode({"top_k": 5}))  # a third set: the memory (size 2) starts over
    assert shared.read(greedy)[0] is not first and shared.read(greedy)[0] == first


def test_min_tokens_over_max_tokens_says_max_tokens():
    """Python callers too get the public name (vLLM's words), whichever name they set the limit with."""
    for limit in ({"max_tokens": 5}, {"num_tokens_to_generate": 5}):
        with pytest.raises(SamplingParamError, match=r"^min_tokens must be less than or equal to max_tokens=5, "
                                                     r"got 10$"):
            SamplingParams(min_tokens=10, **limit)
