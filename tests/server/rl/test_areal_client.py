"""AReaL 1.0.4's own remote engines (:mod:`.areal_client`) generate and complete weight updates against a
``megatron-serve run`` fleet of checkpoint A: ``RemotevLLMEngine``'s completions are A's served completions on
version 0; after its distributed weight update pushed checkpoint B they are B's, on version 1 and the fleet's next
epoch; after its disk update (which waits for the trainer's entry in AReaL's file-based ``name_resolve``) loaded A
again they are A's on version 2, and after ``RemoteSGLangEngine``'s disk update of B, its completions are B's on
version 3: three updates, three epochs.

AReaL runs in ``.venv-verl`` (Ray and the rest of its import chain) with ``.anchors-areal`` on its path
(``make setup``), in a process of its own; the runner's docstring says what is not AReaL's (the trainer's side of
the group).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_serve.tokenizer import Tokenizer

from ...helpers import free_port
from .weight_fleet import (PROMPTS, ROOT, TOKENS, checkpoints, epoch, fleet,  # noqa: F401 - fixtures
                          run_framework, with_key)

VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
pytestmark = pytest.mark.timeout(600)


def run_areal(fleet, model_dir: str, new_model_dir: str, prompts: list[list[int]], work_dir: Path) -> dict:
    addr = with_key(fleet.url, "areal").removeprefix("http://")
    argv = [addr, model_dir, new_model_dir, json.dumps(prompts), str(free_port()), str(work_dir)]
    return run_framework(VERL_PYTHON, "areal_client.py", argv, ".anchors-areal", "areal")


def texts(fleet, outputs: list[dict]) -> list[str]:
    return [fleet.http.post("/detokenize", json={"model": fleet.model, "tokens": o["output_tokens"]}).json()["prompt"]
            for o in outputs]


def test_areals_own_engines_generate_then_update_weights_and_generate_the_new_ones(fleet, checkpoints, tmp_path):
    tokenizer = Tokenizer.from_pretrained(checkpoints.a)
    served = epoch(fleet)
    result = run_areal(fleet, checkpoints.a, checkpoints.b, [tokenizer.encode(p) for p in PROMPTS], tmp_path)

    expected = (("vllm_before", checkpoints.texts.a, 0), ("vllm_after", checkpoints.texts.b, 1),
                ("vllm_disk", checkpoints.texts.a, 2), ("sglang_disk", checkpoints.texts.b, 3))
    for outputs, served_texts, version in expected:
        assert texts(fleet, result[outputs]) == served_texts, outputs
        assert [o["output_versions"] for o in result[outputs]] == [[version] * TOKENS] * len(PROMPTS)
        assert {o["stop_reason"] for o in result[outputs]} == {"length"}
    assert epoch(fleet) == served + 3
