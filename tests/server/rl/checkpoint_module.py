"""A checkpoint as a trainer's model, for the runner scripts of frameworks' own weight-sync clients
(``skyrl_client.py``, ``trl110_client.py``): each walks a ``torch.nn.Module``'s ``named_parameters`` (SkyRL's
``ModuleSource`` over the policy, TRL's ``update_model_params``). The runners import it from their folder
(``sys.path[0]``: each runs as a script of its own)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file


class Checkpoint(torch.nn.Module):
    """A module whose ``named_parameters`` are a checkpoint's tensors under their names, in the checkpoint's order."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.named = sorted(load_file(f"{model_dir}/model.safetensors").items())

    def named_parameters(self, *_, **__):  # noqa: ANN201 - torch's signature
        return iter([(name, torch.nn.Parameter(t, requires_grad=False)) for name, t in self.named])
