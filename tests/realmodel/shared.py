"""What the session's xdist workers share for GGUF files: in the session's shared directory
(:func:`tests.helpers.shared_directory`), the ``XDG_CACHE_HOME`` of the processes that serve a GGUF file, so that
the file's model directory (its config and tokenizer, read from the file: ~10 s of CPU) is made once a session (the
product makes it in a scratch directory renamed into place, so workers that make it at once share the first). Light
to import: test modules outside this folder use it too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import shared_directory


def gguf_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ``XDG_CACHE_HOME`` for GGUF files: out of the user's cache, made once for all the workers.

    torch builds the CPU kernels under ``XDG_CACHE_HOME`` too, so it holds a link to the user's torch extensions: the
    engines served from it load the kernels ``make setup`` built rather than compile all three again each session."""
    home = shared_directory(tmp_path_factory) / "cache"
    home.mkdir(exist_ok=True)
    users = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    link = home / "torch_extensions"
    # A worker whose XDG_CACHE_HOME is already this directory (a session fixture set it) finds the link made.
    if not link.is_symlink() and users.resolve() != link.resolve():
        try:
            link.symlink_to(users, target_is_directory=True)
        except FileExistsError:  # another worker made it at the same time
            pass
    return home
