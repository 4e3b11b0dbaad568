"""What the package root shares with its wings: the distribution's one version, and public names imported on first
use (PEP 562), which the root and its ``model`` and ``server`` wings use.

It imports nothing of the project, so that a wing reaches these without importing the root: the root re-exports the
Python API, which imports the server and the model, so a wing that imported the root would import back up the tree.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

# The distribution's one version: pyproject.toml reads it from here (the Makefile too), and the CLI (--version), the
# HTTP server (OpenAPI), the operator's default image tag, the image label and the chart's appVersion all equal it
# (tests/release/test_versions.py keeps them equal). ``megatron_serve.__version__`` is the same string.
__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """PEP 562 ``__getattr__`` and ``__dir__`` for ``package``, whose names in ``exports`` (name -> its module,
    relative to the package) are imported on first use, so that a process pays for torch, FastAPI or the client only
    when it reads a name that needs them. Any other name is an ``AttributeError``: ``from package import submodule``
    then imports the submodule."""
    namespace = sys.modules[package].__dict__

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_
