"""The weight path's rendezvous admits only the ranks the (encrypted) REFIT told where and under which prefix.

Real ``torch.distributed`` TCP stores on this machine. A rogue process that reaches the sender's
store speaks the store's protocol like any client, but it does not have the transfer's random
prefix: what it writes is not counted, and the store does not even listen where it was not asked to.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import time

import pytest
import torch.distributed as dist

from megatron_serve.weights import group as transfer

pytestmark = pytest.mark.timeout(120)


def rogue_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_a_rogue_that_announces_itself_without_the_prefix_is_not_counted():
    listening = transfer.serve_store("127.0.0.1", timeout=10)
    prefix = secrets.token_hex(16)
    store = transfer.transfer_store(listening, prefix)
    rogue = rogue_store(listening.port)
    # What an engine rank writes, as a process that knows the protocol but not this transfer's prefix.
    rogue.set("world_size", "2")
    rogue.set("joined/1", "1")
    rogue.set(f"{secrets.token_hex(16)}/world_size", "2")  # a guessed prefix
    with pytest.raises(TimeoutError, match="no engine reached the sender's store"):
        transfer.wait_for_ranks(store, time.monotonic() + 0.5, lambda: False)
    transfer.announce(f"127.0.0.1:{listening.port}", prefix, 1, 3, timeout=10)
    transfer.announce(f"127.0.0.1:{listening.port}", prefix, 2, 3, timeout=10)
    assert transfer.wait_for_ranks(store, time.monotonic() + 10, lambda: False) == 3
    assert not rogue.check(["joined/2"])  # nor can it see the ranks' keys


def test_the_store_listens_only_on_the_address_it_was_given():
    listening = transfer.serve_store("127.0.0.1", timeout=10)
    with socket.create_connection(("127.0.0.1", listening.port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):  # another address of this very machine
        socket.create_connection(("127.0.0.2", listening.port), timeout=5).close()
