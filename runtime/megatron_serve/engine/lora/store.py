"""Pushed adapter versions kept as PEFT directories (``--lora-push-dir``), so that engines joining later serve them.

A trainer's push reaches the engines registered at the time, from its memory; nothing is left to reload it
from. With ``--lora-push-dir`` each engine also writes the version it received to ``DIR/<name>/v<version>``
(``adapter_config.json`` + ``adapter_model.safetensors``, the tensors as pushed), then serves it from there: the
coordinator records that directory like a LOAD_LORA's and tells every engine that registers later (a restarted
engine, a scale-up) to load it, as it does for LOAD_LORA. The directory must be one every engine sees at the
same path (a shared volume); the version travels in the config (``megatron_serve_version``), so a joiner
serves it as that version, with that number in its ``lora_epochs``. The write is atomic (a temporary
directory renamed), so a joiner never reads a version half written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from ...model.lora.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from ...wire.rendezvous import LoraPush

VERSION_KEY = "megatron_serve_version"


def save_pushed(root: str, push: LoraPush, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Write version ``push.version`` of ``push.name`` under ``root``; the directory (an existing one is kept: a
    version's tensors never change)."""
    target = Path(root) / push.name / f"v{push.version}"
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".v{push.version}-", dir=target.parent))
    config = {"peft_type": "LORA", "r": push.rank, "lora_alpha": push.alpha, "use_rslora": push.use_rslora,
              "target_modules": push.target_modules, "target_parameters": push.target_parameters,
              VERSION_KEY: push.version}
    (staging / CONFIG_FILE).write_text(json.dumps(config))
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in tensors}, str(staging / WEIGHTS_FILE))
    try:
        os.rename(staging, target)
    except OSError:  # another engine of the fleet wrote the same version first
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise
    return str(target)


def stored_version(path: str) -> int:
    """The version a directory written by :func:`save_pushed` holds; 0 for any other adapter directory."""
    try:
        version = json.loads((Path(path) / CONFIG_FILE).read_text()).get(VERSION_KEY, 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return version if isinstance(version, int) and not isinstance(version, bool) and version >= 0 else 0
