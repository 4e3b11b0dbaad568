"""The model package's error, in a module of its own so that every config module can raise it."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model directory holds something this engine cannot run exactly."""
