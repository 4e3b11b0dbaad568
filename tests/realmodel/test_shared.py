"""The session's GGUF cache home keeps torch's extensions where ``make setup`` built them."""

from __future__ import annotations

from torch.utils.cpp_extension import get_default_build_root

from .shared import gguf_cache_home


def test_engines_served_from_the_sessions_cache_home_find_the_users_built_kernels(tmp_path_factory, monkeypatch):
    """torch builds under ``XDG_CACHE_HOME``: without the link each session compiled the three sources again."""
    users = get_default_build_root()
    monkeypatch.setenv("XDG_CACHE_HOME", str(gguf_cache_home(tmp_path_factory)))
    assert get_default_build_root() == users
    monkeypatch.setenv("XDG_CACHE_HOME", str(gguf_cache_home(tmp_path_factory)))  # asked again under it: the same
    assert get_default_build_root() == users
