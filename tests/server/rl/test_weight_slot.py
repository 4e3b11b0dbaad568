"""The weight slot's 409 says how long the update in the way has not moved in whole seconds passed: a trainer that
reads "last progress 20 s ago" beside "takes over once it has made no progress for 20 s" and sends its init then is
not refused (rounded, 19.5 s read as 20 and the init got a 409: the stalled-trainer test of
test_weight_protocol.py failed on a machine where the replacement's init came at once)."""

from __future__ import annotations

import re
import time

import pytest

from megatron_serve.server.errors import APIError
from megatron_serve.server.rl.weight_slot import Slot


def last_progress(error: APIError) -> int:
    found = re.search(r"last progress (\d+) s ago", str(error.body()["error"]["message"]))
    assert found, error.body()
    return int(found.group(1))


@pytest.mark.parametrize("still", [19.5, 19.99, 20.0, 20.6])
def test_the_seconds_a_409_names_have_passed_and_an_init_then_takes_over(still: float) -> None:
    slot = Slot(stall_s=20.0)
    slot.started_by = "the trainer group at 127.0.0.1:1"
    slot.moved_at = time.monotonic() - still
    said = last_progress(slot.busy())
    assert said <= still  # never more than has passed
    if said >= slot.stall_s:
        assert slot.in_the_way("a new trainer") is not None  # what the message promised
    else:
        with pytest.raises(APIError):
            slot.in_the_way("a new trainer")
