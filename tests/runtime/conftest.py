"""Tiny random models shared by the runtime tests (written once per session)."""

from __future__ import annotations

import pytest

from megatron_serve.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0, arch="llama"))


PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Kubernetes runs containers in pods; an operator watches resources",
    "1 2 3",
    "Once upon a time there was a small model that wanted to learn everything about the world",
    "def add(a, b):",
    "A paged cache splits memory into blocks of a fixed number of tokens, the way an operating system "
    "splits memory into pages. Requests own lists of blocks.",
    "What is the weather like?",
]
