"""Which files hold a model directory's weights: read without torch, so that a process that only checks a model
directory before its engines load it (``run``'s server process) needs none."""

from __future__ import annotations

import json
from pathlib import Path

from .gguf.view import WEIGHTS_LINK


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, from its index when sharded; a GGUF file's directory: the file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if (model_dir / WEIGHTS_LINK).is_file():
        return [model_dir / WEIGHTS_LINK]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint index names missing files: {', '.join(missing)}")
    return files
