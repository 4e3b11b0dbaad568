"""SUBMIT's placement (protocol 7): a session and a data-parallel rank, checked where the frame is decoded."""

from __future__ import annotations

import msgpack
import pytest

from megatron_serve.wire.messages import PROTOCOL_VERSION, TO_COORDINATOR, Submit
from megatron_serve.wire.placement import MAX_SESSION_ID_CHARS, PLACEMENT_PROTOCOL, Placement
from megatron_serve.wire.protocol import Header, ProtocolError, decode, encode


def submit_frame(placement: object) -> bytes:
    return msgpack.packb([int(Header.SUBMIT), {"client_request_id": "a", "prompt": [1], "placement": placement}],
                         use_bin_type=True)


def test_a_placement_travels_typed_and_is_left_out_when_absent():
    body = decode(encode(Header.SUBMIT, Submit(client_request_id="a", prompt=[1], placement=Placement(
        session_id="traj-7", data_parallel_rank=2))), TO_COORDINATOR).body
    assert body.placement == Placement(session_id="traj-7", data_parallel_rank=2)
    assert b"placement" not in encode(Header.SUBMIT, Submit(client_request_id="a", prompt=[1]))
    assert b"data_parallel_rank" not in encode(Header.SUBMIT, Submit(client_request_id="a", prompt=[1],
                                                                     placement=Placement(session_id="s")))
    assert PROTOCOL_VERSION >= PLACEMENT_PROTOCOL == 7


@pytest.mark.parametrize("placement, reason", [
    ({"data_parallel_rank": -1}, r"Expected `int` >= 0 - at `\$.placement.data_parallel_rank`"),
    ({"data_parallel_rank": "1"}, r"Expected `int \| null`, got `str` - at `\$.placement.data_parallel_rank`"),
    ({"session_id": ""}, r"Expected `str` of length >= 1 - at `\$.placement.session_id`"),
    ({"session_id": "s" * (MAX_SESSION_ID_CHARS + 1)}, r"of length <= 256 - at `\$.placement.session_id`"),
    ({"session_id": 7}, r"Expected `str \| null`, got `int` - at `\$.placement.session_id`"),
    ({"sesion_id": "s"}, r"Object contains unknown field `sesion_id` - at `\$.placement`"),
    ([1], r"Expected `object \| null`, got `array` - at `\$.placement`"),
])
def test_a_bad_placement_is_refused_naming_the_field(placement, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(submit_frame(placement), TO_COORDINATOR)
