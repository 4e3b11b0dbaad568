"""Fixtures of the operator suite (helpers in :mod:`tests.operator.helpers`)."""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from .helpers import EXAMPLES, KUBECONFIG, ROOT, Cluster, load_yaml
from .kube_emulator import StrictKubernetesEmulator, kubeconfig_text


@pytest.fixture(params=[pathlib.Path(p).name for p in EXAMPLES])
def example(request: pytest.FixtureRequest) -> dict[str, Any]:
    (doc,) = load_yaml(ROOT / "manifests" / "examples" / request.param)
    return doc


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """A fresh strict emulator on a local port; KUBECONFIG points at it; kopf starts on demand."""
    import kmock

    # OPERATOR_TESTS_KOPF_LOG=DEBUG (with -o log_cli=true) shows what kopf and the operator do
    logging.getLogger("kopf").setLevel(os.environ.get("OPERATOR_TESTS_KOPF_LOG", "WARNING"))
    async with StrictKubernetesEmulator() as emu, kmock.Server(emu) as server:
        url = str(server.url).rstrip("/")
        KUBECONFIG.write_text(kubeconfig_text(url))
        c = Cluster(emu, url, KUBECONFIG)
        try:
            yield c
        finally:
            try:
                await c.close()
            finally:  # even when kopf failed to stop: else the server waits for its open watches as it closes
                await emu.end_watches()


