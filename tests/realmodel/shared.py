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

#: The product's own entry of a cache home (``megatron-serve/gguf``): the one kept out of the user's cache.
PRODUCT_ENTRY = "megatron-serve"
#: The entries of the tools the tests run under the session's home (torch's extensions, pip, uv, ccache): linked to
#: the user's even where the user's has none yet (a fresh machine's pip had written no cache before the suite).
TOOL_ENTRIES = frozenset({"torch_extensions", "pip", "uv", "ccache"})
#: The user's cache home, as this process started with it (a session fixture points ``XDG_CACHE_HOME`` away later).
USERS_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def gguf_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ``XDG_CACHE_HOME`` for GGUF files: out of the user's cache, made once for all the workers.

    Only the product's entry is the session's own; every other entry of the user's cache is a link to the user's. A
    session fixture sets this home for the rest of its worker's session, and every tool run after it there reads
    its cache under it: torch's extensions (the engines would compile all three CPU kernels again), ccache's (the
    release check's kernel build compiled them all), uv's and pip's (the release check's venv and wheel build
    downloaded and unpacked torch and their build tools again)."""
    home = shared_directory(tmp_path_factory) / "cache"
    home.mkdir(exist_ok=True)
    # A process started under this home (its XDG_CACHE_HOME already this directory) finds the links made.
    if USERS_CACHE.resolve() != home.resolve():
        entries = {entry.name for entry in USERS_CACHE.iterdir()} if USERS_CACHE.is_dir() else set()
        for name in sorted((entries | TOOL_ENTRIES) - {PRODUCT_ENTRY}):
            if name in TOOL_ENTRIES:  # the user's, made now where the tool has not yet: it will write there
                (USERS_CACHE / name).mkdir(parents=True, exist_ok=True)
            link = home / name
            if not link.is_symlink():
                try:
                    link.symlink_to(USERS_CACHE / name, target_is_directory=True)
                except FileExistsError:  # another worker made it at the same time
                    pass
    return home
