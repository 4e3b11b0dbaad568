"""TRL 1.10's own ``VLLMClient`` (:mod:`.trl110_client`, trl 1.10.0 pinned beside the venv's 1.16) against a
``megatron-serve run`` fleet of checkpoint A: ``generate`` answers A's served completions, then its weight sync
(``init_communicator``, ``update_model_params``: one REFIT per parameter, as TRL's own server loads each on arrival)
pushes checkpoint B, and ``generate`` answers B's, the fleet's epoch advanced once per parameter.

TRL 1.10 lives in ``.anchors-trl110`` (``make setup``) and runs in a process of its own; the runner's docstring
says what is not TRL's (vLLM's NCCL group, which needs vLLM installed, replaced by gloo's).
"""

from __future__ import annotations

import json
import sys

import pytest
from safetensors.torch import load_file

from megatron_serve.tokenizer import Tokenizer

from ...helpers import free_port
from .weight_fleet import (PROMPTS, TOKENS, checkpoints, epoch, fleet,  # noqa: F401 - fixtures
                          run_framework, with_key)

pytestmark = pytest.mark.timeout(600)


def run_trl110(fleet, model_dir: str, prompts: list[list[int]]) -> dict:
    argv = [with_key(fleet.url, "trl"), model_dir, json.dumps(prompts), str(free_port())]
    return run_framework(sys.executable, "trl110_client.py", argv, ".anchors-trl110", "trl")


def texts(fleet, completion_ids: list[list[int]]) -> list[str]:
    return [fleet.http.post("/detokenize", json={"model": fleet.model, "tokens": ids}).json()["prompt"]
            for ids in completion_ids]


def test_trl_110s_own_vllm_client_generates_then_pushes_a_checkpoint_and_generates_its_completions(
        fleet, checkpoints):
    tokenizer = Tokenizer.from_pretrained(checkpoints.a)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    served = epoch(fleet)
    result = run_trl110(fleet, checkpoints.b, prompts)

    assert result["before"]["prompt_ids"] == prompts
    assert texts(fleet, result["before"]["completion_ids"]) == checkpoints.texts.a
    assert texts(fleet, result["after"]["completion_ids"]) == checkpoints.texts.b
    for answer in (result["before"], result["after"]):
        assert [len(lps) for lps in answer["logprobs"]] == [TOKENS] * len(PROMPTS)
        assert answer["logprob_token_ids"] == [[[t] for t in ids] for ids in answer["completion_ids"]]
    assert epoch(fleet) == served + len(load_file(f"{checkpoints.b}/model.safetensors"))
