"""The resource's coordinator as a process and the kubelet stand-in for its engine pods, for the real-cluster tests
that stream requests through them, with one clean-up for everything they started.

:func:`engines_here` is a fixture: the test starts the stand-in when its resource and operator are in place
(``engines_here(port, name)``), and the fixture's teardown stops it whatever the test did, in reverse order of what
was started, the test's own clean-ups (``.cleanup.callback``: a metrics adapter, an HPA) first."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from tests.helpers import Children

from .real_fleet import Fleet
from .real_kubelet import Kubelet


@dataclass
class EnginesHere:
    """What :func:`engines_here` started: ``children`` (the coordinator, then the engines), the ``kubelet``
    stand-in, the coordinator's ``address`` and ``token``, and the ``env`` every process of the fleet has."""

    children: Children
    kubelet: Kubelet
    address: str
    token: str
    env: dict[str, str]
    cleanup: contextlib.ExitStack

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[InferenceClient]:
        """A client of the coordinator, connected, closed after."""
        client = await InferenceClient(self.address, token=self.token).start(timeout=60)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture
def engines_here(fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path) -> Iterator[Callable[..., EnginesHere]]:
    """``start(port, name, fork=True)``: the coordinator of resource ``name`` (the tiny model on the CPU, the reference
    kernels) on 127.0.0.1:``port`` with the resource's token, and the kubelet stand-in for the resource's engine pods;
    ``fork``: its engines forked from a launcher (:class:`~tests.helpers.Children`), or each exec'd."""
    with contextlib.ExitStack() as cleanup:
        def start(port: int, name: str, fork: bool = True) -> EnginesHere:
            token = fleet.coordinator_token(name)
            env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}
            children = Children(tmp_path, fork=fork)
            cleanup.callback(children.kill_all)
            children.start_launcher(env)  # on this thread, not the kubelet's: its engines are forked from it
            children.coordinator(tiny_model, port, env=env)
            kubelet = Kubelet(fleet, children, tiny_model, port, env, name=name).start()
            cleanup.callback(kubelet.stop)
            return EnginesHere(children, kubelet, f"tcp://127.0.0.1:{port}", token, env, cleanup)

        yield start
