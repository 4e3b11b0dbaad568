"""Fixtures of the security suite: a tiny model per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from megatron_serve.model.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("security-tiny") / "tiny-llama", seed=0))
