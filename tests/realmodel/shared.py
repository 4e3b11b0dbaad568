"""What the session's xdist workers share: a directory of the session's own, and in it the ``XDG_CACHE_HOME`` of the
processes that serve a GGUF file, so that the file's model directory (its config and tokenizer, read from the file:
~10 s of CPU) is made once a session (the product makes it in a scratch directory renamed into place, so workers
that make it at once share the first). Light to import: test modules outside this folder use it too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def shared_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this session that every xdist worker shares (their base directories' parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def gguf_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ``XDG_CACHE_HOME`` for GGUF files: out of the user's cache, made once for all the workers."""
    return shared_directory(tmp_path_factory) / "cache"
