"""The session's GGUF cache home keeps every tool's cache where the user's is, and only the product's GGUF
directories out of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import uv
from torch.utils.cpp_extension import get_default_build_root

from megatron_serve.model.gguf.view import cache_root

from .shared import USERS_CACHE, gguf_cache_home


def test_engines_served_from_the_sessions_cache_home_find_the_users_built_kernels(tmp_path_factory, monkeypatch):
    """torch builds under ``XDG_CACHE_HOME``: without the link each session compiled the three sources again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(USERS_CACHE))
    users = get_default_build_root()
    monkeypatch.setenv("XDG_CACHE_HOME", str(gguf_cache_home(tmp_path_factory)))
    assert get_default_build_root() == users
    monkeypatch.setenv("XDG_CACHE_HOME", str(gguf_cache_home(tmp_path_factory)))  # asked again under it: the same
    assert get_default_build_root() == users


TOOLS = {"uv": [uv.find_uv_bin(), "cache", "dir"], "pip": [sys.executable, "-m", "pip", "cache", "dir"],
         "ccache": ["ccache", "-k", "cache_dir"]}


def cache_directory(tool: str, home: Path) -> Path:
    """Where ``tool`` keeps its cache with ``XDG_CACHE_HOME`` at ``home``, as the tool itself says."""
    env = {**os.environ, "XDG_CACHE_HOME": str(home)}
    return Path(subprocess.run(TOOLS[tool], capture_output=True, text=True, check=True, env=env,
                               stdin=subprocess.DEVNULL).stdout.strip()).resolve()


@pytest.mark.parametrize("tool", list(TOOLS))
def test_tools_run_under_the_sessions_cache_home_use_the_users_cache(tool, tmp_path_factory, monkeypatch):
    """The home stays set on a worker after its session fixture: the release check run there after the real-model
    tests installed its venv through an empty uv cache and compiled the kernels through an empty ccache."""
    if shutil.which(TOOLS[tool][0]) is None:
        pytest.skip(f"{tool} is not installed (`make setup` installs ccache as root, best effort)")
    home = gguf_cache_home(tmp_path_factory)
    assert cache_directory(tool, home) == cache_directory(tool, USERS_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(USERS_CACHE))
    users = cache_root().resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    assert not cache_root().resolve().is_relative_to(users.parent)  # the product's GGUF directories: the session's
