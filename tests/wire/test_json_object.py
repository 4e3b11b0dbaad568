"""vLLM's JSON-object options are read one way: the fleet's command lines and the KV event stream's settings each
refuse a value that is not JSON, or not an object, naming their option."""

from __future__ import annotations

import pytest

from megatron_serve.fleet.argv import kv_transfer_config
from megatron_serve.wire.kv_events import json_object, parse_kv_events_config


def test_text_and_decoded_objects_are_read() -> None:
    assert json_object('{"a": 1}', "--x") == {"a": 1}
    assert json_object({"a": 1}, "--x") == {"a": 1}  # what crossed processes decoded


@pytest.mark.parametrize("value, problem", [
    ("{a: 1}", r"--x must be a JSON object: Expecting property name"),
    ("[1]", r"--x must be a JSON object, got \[1\]"),
    (3, r"--x must be a JSON object, got 3"),
])
def test_anything_else_is_refused_naming_the_option(value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        json_object(value, "--x")


def test_every_reader_names_its_option() -> None:
    with pytest.raises(ValueError, match=r"^--kv-transfer-config must be a JSON object, got \['kv_producer'\]"):
        kv_transfer_config('["kv_producer"]')
    with pytest.raises(ValueError, match=r"^--kv-events-config must be a JSON object: "):
        parse_kv_events_config("not json")
