"""Frame validation, and a few protocol rules checked with a raw DEALER socket."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from megatron_serve.wire.messages import FROM_COORDINATOR, PROTOCOL_VERSION, TO_COORDINATOR
from megatron_serve.wire.protocol import (MAX_MESSAGE_BYTES, Header, ProtocolError, decode, decode_all, encode,
                                         encode_batch, unbatch)

from ..helpers import RawPeer


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("frame, reason", [
    (b"", "empty frame"),
    (b"\xc1", "not msgpack"),
    (pack([1, {}]) + b"x", "trailing characters"),
    (pack({"a": 1}), "must be a list .header, body.: Expected `array`, got `object`"),
    (pack([]), "list of 0 items"),
    (pack([1, {}, 3]), "list of 3 items"),
    (pack([True, {}]), "header must be an integer: Expected `int`, got `bool`"),
    (pack(["HELLO", {}]), "header must be an integer: Expected `int`, got `str`"),
    (pack([999, {}]), "unknown header 999"),
    (pack([int(Header.HELLO_ACK), {"coordinator_id": "x", "state": "RUNNING"}]), "not accepted in this direction"),
    (pack([int(Header.SUBMIT), [1, 2]]), "SUBMIT: Expected `object`, got `array`"),
    (pack([int(Header.SUBMIT), {1: 2}]), "SUBMIT: Expected `str`, got `int` - at `key` in `\\$`"),
    (pack([int(Header.SUBMIT), {"prompt": "hi"}]), "SUBMIT: Object missing required field `client_request_id`"),
    (pack([int(Header.SUBMIT), {"client_request_id": "a", "prompt": 5}]),
     "Expected `str | array`, got `int` - at `\\$.prompt`"),
    (pack([int(Header.SUBMIT), {"client_request_id": "a", "prompt": [3, -1]}]), "Expected `int` >= 0 - at `\\$.prompt.1.`"),
    (pack([int(Header.SUSPEND), {"control_id": "c", "level": True}]), "Expected `int | null`, got `bool` - at `\\$.level`"),
    (pack([int(Header.SUBMIT), {"client_request_id": "a", "prompt": "x", "stream": 1}]),
     "Expected `bool | null`, got `int` - at `\\$.stream`"),
    (b"\x91" * 5000, "not msgpack"),
])
def test_malformed_frames_are_explained(frame, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(frame, TO_COORDINATOR)


def test_oversize_is_refused_both_ways():
    with pytest.raises(ProtocolError, match="oversize frame"):
        decode(b"\x00" * 11, TO_COORDINATOR, max_bytes=10)
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(Header.SUBMIT, {"client_request_id": "a", "prompt": "x" * (MAX_MESSAGE_BYTES + 1)})


def test_round_trip_and_extras_ignored():
    body = {"client_request_id": "r1", "prompt": [1, 2, 3], "sampling_params": {"temperature": 0.0},
            "stream": True, "from_the_future": 42}
    header, decoded = decode(encode(Header.SUBMIT, body), TO_COORDINATOR)
    assert header is Header.SUBMIT and (decoded.client_request_id, decoded.prompt, decoded.stream) == ("r1", [1, 2, 3], True)
    assert msgpack.unpackb(bytes(decoded.sampling_params)) == {"temperature": 0.0}  # forwarded as it came
    assert decode(pack([int(Header.HEARTBEAT)]), TO_COORDINATOR).body.engine_id is None
    header, decoded = decode(encode(Header.ABORT, {"request_id": "k"}), FROM_COORDINATOR)
    assert header is Header.ABORT and decoded.request_id == "k"
    # the same body in the other direction names the client's id
    assert decode(encode(Header.ABORT, {"client_request_id": 7}), TO_COORDINATOR).body.client_request_id == 7


def test_a_batch_carries_whole_messages_and_an_unreadable_one_is_dropped_alone():
    frames = [encode(Header.HEARTBEAT, {}), pack([int(Header.SUBMIT), {"prompt": 1}]), encode(Header.STATUS, {"status_id": 3})]
    header, batch = decode(encode_batch(frames), TO_COORDINATOR)
    items = list(unbatch(batch, TO_COORDINATOR))
    assert header is Header.BATCH and [type(i).__name__ for i in items] == ["Message", "ProtocolError", "Message"]
    assert items[2].body.status_id == 3
    nested = list(unbatch(decode(encode_batch([encode_batch(frames)]), TO_COORDINATOR).body, TO_COORDINATOR))
    assert isinstance(nested[0], ProtocolError) and "inside a BATCH" in str(nested[0])
    assert int(Header.REFIT) == 26  # reserved for the refit issue; numbers are part of the contract


def test_the_retired_tokens_header_is_refused_by_number_and_never_reused():
    """Protocol 6 retired ``TOKENS`` (11): a frame of it is refused with one line naming the number, and no header
    took its number."""
    assert 11 not in {int(header) for header in Header}
    with pytest.raises(ProtocolError, match="unknown header 11"):
        decode(pack([11, {"client_request_id": "r", "new_tokens": [1]}]), FROM_COORDINATOR)
    assert decode(encode(Header.STEP_TOKENS, {"client_request_ids": ["r"], "deltas": [{"new_tokens": [1]}]}),
                  FROM_COORDINATOR).body.deltas[0].new_tokens == [1]  # the control: the one token message


def test_decode_all_reads_a_batch_in_one_call_as_message_by_message_and_drops_a_bad_one_alone():
    tokens = [encode(Header.STEP_TOKENS, {"client_request_ids": [f"r{i}"], "deltas": [{"new_tokens": [i, i + 1]}]})
              for i in range(5)]
    frame = encode_batch(tokens)
    assert decode_all(frame, FROM_COORDINATOR) == list(unbatch(decode(frame, FROM_COORDINATOR).body, FROM_COORDINATOR))
    assert [m.body.deltas[0].new_tokens for m in decode_all(frame, FROM_COORDINATOR)] == [[i, i + 1] for i in range(5)]
    assert decode_all(tokens[0], FROM_COORDINATOR) == [decode(tokens[0], FROM_COORDINATOR)]  # a lone message
    bad = pack([int(Header.STEP_TOKENS), {"client_request_ids": ["x"], "deltas": [{"new_tokens": "not a list"}]}])
    items = decode_all(encode_batch([tokens[0], bad, encode_batch(tokens[1:3]), tokens[3]]), FROM_COORDINATOR)
    assert [type(i).__name__ for i in items] == ["Message", "ProtocolError", "ProtocolError", "Message"]
    assert "inside a BATCH" in str(items[2]) and items[3].body.client_request_ids == ["r3"]
    with pytest.raises(ProtocolError, match="not msgpack"):
        decode_all(b"\x92\x01", FROM_COORDINATOR)


def test_retried_hello_keeps_one_registration(fleet_factory):
    fleet = fleet_factory()
    peer = RawPeer(fleet.address, fleet.token)
    try:
        hello = {"role": "engine", "capacity": 4}
        peer.send(Header.HELLO, hello)
        peer.send(Header.HELLO, hello)
        first, second = peer.recv(), peer.recv()
        assert first.header is second.header is Header.HELLO_ACK
        assert first.body.engine_id == second.body.engine_id
        peer.send(Header.STATUS, {})
        reply = peer.recv()
        while reply.header is not Header.STATUS_REPLY:
            reply = peer.recv()
        assert len(reply.body.engines) == 1
    finally:
        peer.close()


def test_an_insecure_coordinator_tells_a_stranger_to_hello(fleet_factory):
    fleet = fleet_factory(insecure=True)
    peer = RawPeer(fleet.address, None)
    try:
        peer.send(Header.STATUS, {})
        answer = peer.recv()
        assert answer.header is Header.ERROR and answer.body.code == "hello_required"
        peer.send(Header.HELLO, {"role": "client"})
        assert peer.recv().header is Header.HELLO_ACK
    finally:
        peer.close()


def test_resubmission_that_already_reached_its_length_finishes_at_once(fleet_factory):
    fleet = fleet_factory()  # no engines at all: nothing could compute it
    peer = RawPeer(fleet.address, fleet.token)
    try:
        peer.send(Header.HELLO, {"role": "client", "client_id": "c1", "protocol": PROTOCOL_VERSION})
        assert peer.recv().header is Header.HELLO_ACK
        peer.send(Header.SUBMIT, {"client_request_id": "r", "prompt": [1, 2],
                                  "sampling_params": {"num_tokens_to_generate": 3}, "generated_tokens": [7, 8, 9]})
        answer = peer.recv()
        assert answer.header is Header.RESULT
        record = msgspec.msgpack.decode(answer.body.request)  # a FinalRecord: the client decodes it on its own
        assert "generated_tokens" not in record  # the client has them: the record does not repeat them
        assert record["status"] == "COMPLETED" and record["finish_reason"] == "length"
    finally:
        peer.close()


RICH = [
    (TO_COORDINATOR, Header.SUBMIT, {"client_request_id": 3, "prompt": "hi", "sampling_params": {"top_k": 2},
                                     "generated_tokens": [4], "images": [{"data": b"\x89PNG", "length": 4}]}),
    (TO_COORDINATOR, Header.ENGINE_STEP, {"engine_id": "e", "outputs": [{"request_id": "c/r", "new_tokens": [1],
                                                                           "finished": True}],
                                          "records": {"c/r": {"a": 1}}}),
    (TO_COORDINATOR, Header.HELLO, {"role": "engine", "engine_group": 1, "capacity": 8, "info": {"x": [1]},
                                    "protocol": 3}),
    (TO_COORDINATOR, Header.RESULT_ACK, {"client_request_ids": ["a", 2]}),
    (FROM_COORDINATOR, Header.RESULT, {"client_request_id": "r", "request": {"status": "COMPLETED"}}),
    (FROM_COORDINATOR, Header.STEP_TOKENS, {"client_request_ids": ["r"], "deltas": [{"new_tokens": [1, 2],
                                                                                       "top_logprobs": [[[1, -0.5]]]}],
                                            "starts": [3]}),
    (FROM_COORDINATOR, Header.HELLO_ACK, {"coordinator_id": "c", "state": "PAUSED", "protocol": 3}),
]


@pytest.mark.parametrize("table", [TO_COORDINATOR, FROM_COORDINATOR], ids=["to", "from"])
def test_the_one_call_decoder_reads_every_body_as_the_checked_one_does(table):
    """decode() reads a well-formed frame in one msgspec call and falls back to the step-by-step
    checks only to explain a bad one: both must give the same message for every header."""
    from megatron_serve.wire.protocol import _decode_checked
    rich = [(header, body) for t, header, body in RICH if t is table]
    empty = []
    for header in table:
        try:
            _decode_checked(encode(header, {}), table)
        except ProtocolError:
            continue  # a body with required fields: {} is a bad frame, explained by the checked path
        empty.append((header, {}))
    assert empty  # HEARTBEAT at least
    for header, body in rich + empty:
        frame = encode(header, body)
        assert decode(frame, table) == _decode_checked(frame, table), header


def test_a_table_gets_its_own_decoder_even_where_a_dropped_table_had_the_same_id():
    """The one-call decoders are cached by the table's id: a table made and dropped must not leave its
    decoder to a later table at the same address (that one accepted headers outside its own table)."""
    for _ in range(50):
        wider = {Header.HELLO: dict, Header.HEARTBEAT: dict}
        assert decode(encode(Header.HEARTBEAT, {}), wider).header is Header.HEARTBEAT
        del wider
        with pytest.raises(ProtocolError, match="HEARTBEAT is not accepted in this direction"):
            decode(encode(Header.HEARTBEAT, {}), {Header.HELLO: dict})
