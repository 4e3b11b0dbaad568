"""lm-eval on the real model: the repository's two tasks (benchmarks/evals) run by lm-eval's ``local-completions``
(log-likelihoods through echo and prompt log probs) and ``local-chat-completions`` (greedy generation through the
chat template) against a ``megatron-serve serve`` of SmolLM2's GGUF file, and by lm-eval's own ``hf`` backend on
the session's transformers load of the same file: every item the same choice (log-likelihoods within
``LOGLIKELIHOOD_TOLERANCE``) or the same text, so the same score. A few items of each here;
``benchmarks/lm_eval_parity.py`` runs them all (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from megatron_serve.model.hub import resolve_model

from tests.helpers import script_module

if TYPE_CHECKING:
    from lm_eval.models.huggingface import HFLM

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval_parity.py"
# the first 4 items of each task: the check is per item (the same choice and log-likelihoods, or the same text), so a
# few items of each task type say it (it held 12 multiple-choice items before, for ~3x the CPU of this case)
LIMITS = {"megatron_facts_mc": 4, "megatron_facts_gen": 4}


@pytest.fixture(scope="module")
def parity():
    import lm_eval.evaluator  # noqa: PLC0415 - here, not in every worker's collection

    with script_module("lm_eval_parity", SCRIPT) as module, pytest.MonkeyPatch.context() as patch:
        # each simple_evaluate records the machine in its results (torch's collect_env: pip list, gcc, lscpu, ... as
        # subprocesses, and git): ~1.2 s of CPU an evaluate, for results the test does not read (only the items)
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        patch.setattr(lm_eval.evaluator, "get_git_commit_hash", lambda: None)
        yield module


@pytest.fixture(scope="module")
def server(parity, smollm2, gguf_cache, tmp_path_factory):
    with parity.server(smollm2, "float32", tmp_path_factory.mktemp("lm_eval") / "serve.log") as (url, name):
        yield url, name


@pytest.fixture(scope="module")
def hf(reference) -> HFLM:
    """lm-eval's ``hf`` backend on the session's transformers model (float32, CPU), one item at a time."""
    from lm_eval.models.huggingface import HFLM  # here, not at module level: ~0.8 s of every worker's collection

    model, tokenizer = reference
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)


@pytest.mark.parametrize("task", list(LIMITS))
def test_lm_eval_scores_every_item_as_its_hf_backend(parity, server, hf, smollm2, task):
    url, name = server
    ours = parity.items(parity.served(url, name, resolve_model(smollm2), task, LIMITS[task]), task)
    theirs = parity.items(parity.evaluate(hf, task, LIMITS[task]), task)

    assert len(ours) == len(theirs) == LIMITS[task]
    assert [item.score for item in ours] == [item.score for item in theirs]
    disagreeing = [(a, b) for a, b in zip(ours, theirs, strict=True) if not parity.agree(a, b)]
    assert not disagreeing
    assert sum(item.score for item in ours) >= LIMITS[task] / 2  # a trained model: mostly right on these items
