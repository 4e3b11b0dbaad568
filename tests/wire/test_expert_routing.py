"""Routing rows: written once per position, delivered once, and parsed strictly from the wire."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_serve import SamplingParams
from megatron_serve.wire.expert_routing import (RoutingCapture, RoutingRecord, mirror_rows, routing_dtype,
                                                routing_from_wire, routing_to_wire)


def rows(first: int, count: int, layers: int = 2, top_k: int = 3) -> np.ndarray:
    return (np.arange(first, first + count)[:, None, None] + np.zeros((1, layers, top_k), dtype=int)).astype(np.uint8)


def test_positions_already_recorded_keep_their_first_rows():
    record = RoutingRecord(2, 3, np.dtype(np.uint8))
    record.record(0, rows(0, 5))
    record.record(0, rows(100, 7))  # a recomputation from the start (preemption): only positions 5, 6 are new
    assert record.array()[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 105, 106]
    with pytest.raises(RuntimeError, match="position 9 computed before position 7"):
        record.record(9, rows(9, 1))


def test_the_engine_delivers_each_row_once_and_keeps_none_it_delivered():
    capture = RoutingCapture(2, 3, np.dtype(np.uint8))
    capture.record(0, rows(0, 5))
    start, first = capture.take_undelivered()
    assert start == 0 and first[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    capture.record(0, rows(100, 7))  # a recomputation from the start (preemption): only positions 5, 6 are new
    capture.record(7, rows(7, 1))
    start, fresh = capture.take_undelivered()
    assert start == 5 and fresh[:, 0, 0].tolist() == [105, 106, 7]
    assert capture.take_undelivered() is None and capture._chunks == []  # nothing new, nothing kept
    with pytest.raises(RuntimeError, match="position 9 computed before position 8"):
        capture.record(9, rows(9, 1))


def test_a_continuation_starts_after_the_rows_it_carries():
    capture = RoutingCapture(2, 3, np.dtype(np.uint8), recorded=4)
    capture.record(2, rows(2, 3))
    assert capture.take_undelivered()[0] == 4 and capture.count == 5
    record = RoutingRecord(2, 3, np.dtype(np.uint8), rows(0, 4))
    assert record.count == 4
    with pytest.raises(ValueError, match="do not fit this model's 1 MoE layers x top-3"):
        RoutingRecord(1, 3, np.dtype(np.uint8), rows(0, 4))


def test_coordinator_mirror_extends_in_order_only():
    mirror = mirror_rows(None, {"start": 0, **routing_to_wire(rows(0, 3))})
    mirror = mirror_rows(mirror, {"start": 2, **routing_to_wire(rows(2, 3))})  # position 2 again: kept once
    assert mirror.array()[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="from position 9 do not continue the 5 rows"):
        mirror_rows(mirror, {"start": 9, **routing_to_wire(rows(9, 1))})
    with pytest.raises(ValueError, match="start must be a non-negative integer"):
        mirror_rows(mirror, routing_to_wire(rows(5, 1)))


@pytest.mark.parametrize(("wire", "message"), [
    ([], "must be a map"),
    ({"shape": [1, 2], "dtype": "uint8", "data": b"\0\0"}, "three non-negative integers"),
    ({"shape": [1, 1, 2], "dtype": "int64", "data": b"\0\0"}, "dtype must be one of"),
    ({"shape": [1, 1, 2], "dtype": "uint16", "data": b"\0\0"}, "does not hold"),
])
def test_bad_wire_forms_are_named(wire, message):
    with pytest.raises(ValueError, match=message):
        routing_from_wire(wire)


def test_ids_of_many_experts_take_two_bytes():
    assert routing_dtype(256) == np.uint8 and routing_dtype(257) == np.uint16
    wide = np.array([[[300, 7]]], dtype=np.uint16)
    np.testing.assert_array_equal(routing_from_wire(routing_to_wire(wide)), wide)


def test_sampling_param_is_a_bool_and_stays_off_the_wire_when_off():
    with pytest.raises(ValueError, match="return_routing_indices must be a bool"):
        SamplingParams(return_routing_indices=1)
    assert "return_routing_indices" not in SamplingParams().to_dict()
    assert SamplingParams.from_dict(SamplingParams(return_routing_indices=True).to_dict()).return_routing_indices
