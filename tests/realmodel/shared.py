"""What the session's xdist workers share for GGUF files: in the session's shared directory
(:func:`tests.helpers.shared_directory`), the ``XDG_CACHE_HOME`` of the processes that serve a GGUF file, so that
the file's model directory (its config and tokenizer, read from the file: ~10 s of CPU) is made once a session (the
product makes it in a scratch directory renamed into place, so workers that make it at once share the first). Light
to import: test modules outside this folder use it too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import shared_directory


def gguf_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ``XDG_CACHE_HOME`` for GGUF files: out of the user's cache, made once for all the workers."""
    return shared_directory(tmp_path_factory) / "cache"
