"""TRL 1.10's own ``VLLMClient`` (``trl/generation/vllm_client.py``, trl 1.10.0) against a server: generation, its
weight sync of a checkpoint (``init_communicator``, ``update_model_params``, ``reset_prefix_cache``,
``close_communicator``), generation again.

``python trl110_client.py BASE_URL MODEL_DIR PROMPTS_JSON GROUP_PORT`` with ``.anchors-trl110`` first on
``PYTHONPATH`` (``trl==1.10.0`` installed there ``--no-deps``, ``make setup``; the venv's TRL is 1.16). ``BASE_URL``
carries the admin key as the password of its userinfo, which TRL's ``requests`` session sends as HTTP Basic (TRL
keeps the URL's netloc whole). Prints one JSON line: ``{"before", "after"}``, each ``generate``'s answer.

What is not TRL's, and why: TRL 1.10 imports vLLM's ``PyNcclCommunicator`` and ``StatelessProcessGroup`` only where
vLLM is installed, and ``VLLMClient()`` refuses to start without it (``is_vllm_available``); vLLM itself cannot be
installed here (its ``LLM``, which ``trl/generation/vllm_generation.py`` imports at once when vLLM is importable,
needs its whole CUDA dependency tree). So ``is_vllm_available`` answers True to the client, its weight group is
gloo's (:mod:`megatron_serve.client.trainer_group`, the client the last rank of the store the server serves, keys
under TRL's ``client2server``, as TRL 1.10's XPU branch builds it) in place of NCCL's, and the device's UUID is
TRL's own fallback ``"42"`` (``torch.cuda.get_device_properties`` needs CUDA).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import trl
import trl.generation.vllm_client as trl_vllm

from checkpoint_module import Checkpoint  # beside this script (its folder: sys.path[0])
from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights
from megatron_serve.weights.framework_groups import TRL_PREFIX

TOKENS = 8


class GlooGroup:
    """``StatelessProcessGroup.create`` as TRL 1.10 calls it, over gloo."""

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int) -> SimpleNamespace:
        group = trainer_init(host, port, world_size, rank=rank, prefixes=(TRL_PREFIX,), serves_store=False,
                             timeout=120)
        return SimpleNamespace(pg=group, barrier=lambda: group.barrier().wait())


class GlooCommunicator:
    """``PyNcclCommunicator(pg, device)``: ``broadcast(tensor, src)`` and ``group.barrier()``, as TRL calls them."""

    def __init__(self, group: SimpleNamespace, device: object) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        trainer_send_weights([("", tensor)], self.group.pg, src=src)


def main(base_url: str, model_dir: str, prompts: list[list[int]], port: int) -> dict:
    assert trl.__version__ == "1.10.0", trl.__version__
    trl_vllm.is_vllm_available = lambda *_, **__: True
    trl_vllm.StatelessProcessGroup = GlooGroup
    trl_vllm.PyNcclCommunicator = GlooCommunicator
    torch.cuda.get_device_properties = lambda *_: SimpleNamespace(uuid="42")

    client = trl_vllm.VLLMClient(base_url=base_url, group_port=port, connection_timeout=60)

    def generate() -> dict:
        return client.generate(prompts, temperature=0.0, max_tokens=TOKENS, logprobs=0,
                               generation_kwargs={"ignore_eos": True})

    before = generate()
    client.init_communicator(device=0)
    client.update_model_params(Checkpoint(model_dir))
    client.reset_prefix_cache()
    client.close_communicator()
    return {"before": before, "after": generate()}


if __name__ == "__main__":
    base_url, model_dir, prompts_json, port = sys.argv[1:5]
    print(json.dumps(main(base_url, model_dir, json.loads(prompts_json), int(port))), flush=True)
