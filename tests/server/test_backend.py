"""The server reads its client through one protocol (``server.backend.Backend``), and both clients implement all of it:
a call the server makes is never probed for at run time, so a client that lacked one would fail here, not in a route.
"""

from __future__ import annotations

import inspect

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.client.local_engine import LocalEngineClient
from megatron_serve.server.backend import Backend

CALLS = sorted(name for name in vars(Backend) if not name.startswith("_"))


def test_the_protocol_lists_every_call_the_server_makes():
    assert CALLS == ["abort", "add_request", "add_request_streaming_to", "connected", "control",
                     "load_lora_adapter", "start", "status", "unload_lora_adapter"]


@pytest.mark.parametrize("client", [InferenceClient, LocalEngineClient])
@pytest.mark.parametrize("name", CALLS)
def test_each_client_takes_each_call_as_the_server_makes_it(client, name):
    wanted, have = getattr(Backend, name), getattr(client, name, None)
    assert have is not None, f"{client.__name__} lacks {name}"
    if isinstance(wanted, property):
        assert isinstance(have, property)
        return
    assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(wanted)
    params = inspect.signature(have).parameters
    for param in inspect.signature(wanted).parameters.values():
        assert param.name in params and params[param.name].kind == param.kind, (client.__name__, name, param)
