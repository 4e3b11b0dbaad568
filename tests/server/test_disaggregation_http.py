"""Prefill/decode disaggregation over a real ``megatron-serve run --prefill-engines 1 --decode-engines 1``
(coordinator, two engine processes, HTTP): the prefill engine computes each prompt and its first token, its KV
blocks go through the coordinator to the decode engine, which continues from them.

Under ``--batch-invariant`` the tokens and log probs are ``==`` a colocated engine's (the same engine and settings,
served in this process in direct mode: a fleet of its own would check nothing more), with engines of one rank, of two
tensor-parallel ranks and of two pipeline stages (each rank hands its part of the blocks on; the colocated engine has
the same layout). That the prompt was
not computed again: the two engines together ran exactly the tokens the colocated engine ran
(``megatron_serve_engine_computed_tokens``), each prompt token once and each generated token but the last once,
where a decode engine that computed the context itself would have run every prompt again.
``/metrics`` counts the transfers and their bytes on both sides.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from megatron_serve.tokenizer import Tokenizer

from ..processes import stop_process_group
from .conftest import surface, wait_ready
from .test_openai_e2e import free_port

pytestmark = [pytest.mark.timeout(600)]

BLOCK = 16
MAX_TOKENS = 6


@contextmanager
def fleet(model: str, log_dir, *extra: str) -> Iterator[SimpleNamespace]:
    port = free_port()
    log_dir.mkdir()
    output = log_dir / "run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", model, "--port", str(port),
             "--coordinator-port", "0", "--num-kv-blocks", "64", "--block-size", str(BLOCK), "--max-num-seqs", "4",
             "--batch-invariant", "--log-dir", str(log_dir), *extra],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, output)
        with httpx.Client(base_url=url, timeout=120) as http:
            yield SimpleNamespace(http=http, model=os.path.basename(model), proc=proc, log_dir=log_dir)
    finally:
        stop_process_group(proc)


def prompts() -> list[list[int]]:
    rng = random.Random(51)
    return [[rng.randrange(5, 500) for _ in range(length)] for length in (2 * BLOCK + 5, 3 * BLOCK, 7, BLOCK + 1)]


#: :func:`fleet`'s engine settings (its flags), as ``InferenceConfig`` fields
COLOCATED = {"num_kv_blocks": 64, "block_size_tokens": BLOCK, "max_requests": 4, "batch_invariant": True}


def body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}


def complete(served: SimpleNamespace, prompt: list[int]) -> dict:
    answer = served.http.post("/v1/completions", json=body(served.model, prompt))
    assert answer.status_code == 200, answer.text
    return answer.json()


async def colocated(model: str, sent: list[list[int]], once: int, **layout: int
                    ) -> tuple[list[tuple[list[str], list[float]]], float]:
    """The tokens and log probs of ``sent`` on one colocated engine (direct mode, the fleets' settings and
    ``layout``), and the tokens it computed (``/metrics`` once its counter reached ``once``)."""
    async with surface(model, Tokenizer.from_pretrained(model), **COLOCATED, **layout) as (_, http):
        expected = []
        for prompt in sent:
            answer = await http.post("/v1/completions", json=body("tiny-llama", prompt))
            assert answer.status_code == 200, answer.text
            expected.append(tokens_and_log_probs(answer.json()))
        deadline = time.monotonic() + 60
        while (control := computed((await http.get("/metrics")).text) or 0) < once and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    return expected, control


def tokens_and_log_probs(answer: dict) -> tuple[list[str], list[float]]:
    logprobs = answer["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def series(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` by its label text."""
    return {labels: float(value) for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def metrics_when(served: SimpleNamespace, ready) -> str:
    """``/metrics`` once ``ready(text)`` holds (the engines' heartbeats carry their counters a moment later)."""
    deadline = time.monotonic() + 60
    while True:
        text = served.http.get("/metrics").text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def computed(text: str) -> float | None:
    """The tokens every engine of the fleet ran through its model (None before their heartbeats say)."""
    found = re.search(r"^megatron_serve_engine_computed_tokens (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


#: Engine groups the prefill and decode engines are (their flags, and the colocated engine's layout): one rank
#: each, or groups whose every rank holds a part of each block (its heads, its stage's layers) and hands it on
#: with rank 0's
LAYOUTS = {"one rank": ((), {}), "tensor parallel": (("--tensor-parallel", "2"), {"tensor_parallel_size": 2}),
           "pipeline": (("--pipeline-parallel-size", "2"), {"pipeline_parallel_size": 2})}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
async def test_disaggregated_tokens_equal_a_colocated_run_and_the_prompt_is_computed_once(tiny_llama, tmp_path,
                                                                                          layout):
    flags, config = LAYOUTS[layout]
    sent = prompts()
    once = sum(map(len, sent)) + len(sent) * (MAX_TOKENS - 1)  # each prompt token, each generated one but the last
    expected, control = await colocated(tiny_llama, sent, once, **config)
    with fleet(tiny_llama, tmp_path / "pd", "--prefill-engines", "1", "--decode-engines", "1", *flags) as pd:
        answers = [complete(pd, prompt) for prompt in sent]
        # Both ends' counters: each engine's heartbeat carries its own, the sender's a moment apart from the receiver's.
        text = metrics_when(pd, lambda t: (computed(t) or 0) >= once and all(
            sum(v for k, v in series(t, "megatron_serve_kv_transfers_total").items() if f'direction="{way}"' in k)
            >= len(sent) for way in ("sent", "received")))
    assert [tokens_and_log_probs(answer) for answer in answers] == expected
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in expected)
    transfers = series(text, "megatron_serve_kv_transfers_total")
    moved = series(text, "megatron_serve_kv_transfer_bytes_total")
    by = {(re.search(r'engine_group="(\d+)"', k).group(1), re.search(r'direction="(\w+)"', k).group(1)): v
          for k, v in transfers.items()}
    assert by[("0", "sent")] == by[("1", "received")] == len(sent), transfers
    assert by[("0", "received")] == by[("1", "sent")] == 0, transfers
    sent_bytes = [v for k, v in moved.items() if 'engine_group="0"' in k and 'direction="sent"' in k]
    received_bytes = [v for k, v in moved.items() if 'engine_group="1"' in k and 'direction="received"' in k]
    assert sent_bytes == received_bytes and sent_bytes[0] > 0, moved
    # The prompt ran once, on the prefill engine; the decode engine ran the first token and what followed it.
    assert computed(text) == control == once
