"""Bad sampling values are refused with a message naming the field."""

from __future__ import annotations

import pytest

from megatron_serve import InferenceConfig, SamplingParams


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
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


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
