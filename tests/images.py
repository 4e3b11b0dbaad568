"""Image files for the vision-language tests: deterministic noise, so every test sees the same pixels."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png(height: int, width: int, seed: int) -> bytes:
    """A ``height`` x ``width`` RGB noise image as a PNG file."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
