"""SkyRL 0.4.0's own client code (:mod:`.skyrl_client`) generates and completes a weight update against a
``megatron-serve run`` fleet of checkpoint A: its completions are A's served completions on epoch 0, then, after its
fully-async weight sync pushed checkpoint B, B's served completions, every token on the next epoch.

SkyRL's and vLLM's code come from ``.anchors`` (``make setup``); the runner is a process of its own, since importing
vLLM changes what TRL imports in a test process. Where it departs from SkyRL as it ships (gloo for vLLM's NCCL, the
package ``__init__`` that needs Python 3.12) the runner's docstring says exactly what.
"""

from __future__ import annotations

import json
import sys

import pytest

from megatron_serve.tokenizer import Tokenizer

from ...helpers import free_port
from .weight_fleet import (ADMIN_KEY, PROMPTS, TOKENS, checkpoints, epoch, fleet,  # noqa: F401 - fixtures
                          run_framework, with_key)

pytestmark = pytest.mark.timeout(600)


def run_skyrl(fleet, model_dir: str, prompts: list[list[int]]) -> dict:
    argv = [fleet.url, with_key(fleet.url, "skyrl"), fleet.model, model_dir, json.dumps(prompts), str(free_port())]
    return run_framework(sys.executable, "skyrl_client.py", argv, ".anchors", "skyrl")


def test_skyrls_own_clients_generate_then_push_a_checkpoint_and_generate_its_completions(fleet, checkpoints):
    tokenizer = Tokenizer.from_pretrained(checkpoints.a)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    served = epoch(fleet)
    result = run_skyrl(fleet, checkpoints.b, prompts)

    assert result["before"]["responses"] == checkpoints.texts.a
    assert result["after"]["responses"] == checkpoints.texts.b
    for output in (result["before"], result["after"]):
        assert [len(ids) for ids in output["response_ids"]] == [TOKENS] * len(PROMPTS)
        assert output["stop_reasons"] == ["length"] * len(PROMPTS)
        assert [len(lps) for lps in output["logprobs"]] == [TOKENS] * len(PROMPTS)
    assert result["world_size"] == 1 and result["weight_version"] == 1
    assert epoch(fleet) == served + 1
    state = fleet.http.get("/v1/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert state["state"] == "RUNNING"  # SkyRL's resume_generation after its keep-mode pause
