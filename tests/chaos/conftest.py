"""The chaos suite's tiny model (written once per session)."""

from __future__ import annotations

import pytest

from megatron_serve.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("chaos-tiny"), seed=0))
