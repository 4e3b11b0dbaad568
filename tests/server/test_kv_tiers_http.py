"""The host KV tier and suspend with keep_kv over a real ``megatron-serve run`` (coordinator, engine process, HTTP).

The device pool (24 blocks of 16 tokens) is smaller than the working set (six prompts of five cacheable blocks):
sent again, the prompts find their prefixes in the host tier with texts and log probs ``==`` the first pass
under ``--batch-invariant``; the same fleet without ``--kv-offloading-size`` finds few; after a refit none.
A stream in flight through pause, suspend with ``keep_kv``, resume and unpause ends as an uninterrupted one,
and the engines compute no token of it twice (``megatron_serve_engine_computed_tokens``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from ..processes import stop_process_group
from .conftest import metric, wait_ready
from .test_openai_e2e import free_port

pytestmark = [pytest.mark.timeout(600)]

ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BLOCK = 16
ENGINE = 'engine_group="0",model_name="{model}"'


@contextmanager
def fleet(model: str, log_dir, *extra: str) -> Iterator[SimpleNamespace]:
    key_file = log_dir / "admin-key"
    key_file.write_text(ADMIN_KEY + "\n")
    port = free_port()
    output = log_dir / "run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", model, "--port", str(port),
             "--coordinator-port", "0", "--num-kv-blocks", "24", "--block-size", str(BLOCK), "--max-num-seqs", "2",
             "--batch-invariant", "--log-dir", str(log_dir), "--admin-key-file", str(key_file), *extra],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, output)
        with httpx.Client(base_url=url, timeout=120) as http:
            yield SimpleNamespace(http=http, model=os.path.basename(model), path=model)
    finally:
        stop_process_group(proc)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 500) for _ in range(5 * BLOCK + 3)] for _ in range(6)]


def complete(served: SimpleNamespace, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    answer = served.http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def admin(served: SimpleNamespace, verb: str, body: dict | None = None) -> dict:
    answer = served.http.post(f"/v1/admin/{verb}", content=json.dumps(body or {}).encode(),
                              headers={"Content-Type": "application/json", **ADMIN})
    assert answer.status_code == 200, answer.text
    return answer.json()


def counters_after(served: SimpleNamespace, generated: float) -> str:
    """``/metrics`` once the engine's heartbeat counts ``generated`` tokens (every request sent so far)."""
    deadline = time.monotonic() + 30
    while True:
        text = served.http.get("/metrics").text
        try:
            counted = metric(text, "megatron_serve_generation_tokens_total", ENGINE.format(model=served.model))
        except KeyError:  # the engine's first heartbeats may carry no metrics yet: poll on
            counted = -1.0
        if counted >= generated:
            return text
        assert time.monotonic() < deadline, "the engine's heartbeat never counted the tokens"
        time.sleep(0.1)


def two_passes(served: SimpleNamespace) -> tuple[list[dict], list[dict]]:
    batch = prompts()
    return [complete(served, p) for p in batch], [complete(served, p) for p in batch]


def cached(answers: list[dict]) -> list[int]:
    return [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]


def choice(answer: dict) -> tuple:
    first = answer["choices"][0]
    return first["text"], first["logprobs"]["token_logprobs"]


def test_prefixes_come_back_from_the_host_tier_bitwise_a_control_finds_few_a_refit_none(tiny_model,
                                                                                       tmp_path_factory):
    with fleet(tiny_model, tmp_path_factory.mktemp("kv-tier"), "--kv-offloading-size", "0.01") as served:
        first, second = two_passes(served)
        assert [choice(a) for a in second] == [choice(a) for a in first]
        assert cached(first) == [0] * 6 and cached(second) == [5 * BLOCK] * 6
        text = counters_after(served, 12 * 4)
        engine = ENGINE.format(model=served.model)
        hits = metric(text, "megatron_serve_external_prefix_cache_hits_total", engine)
        assert hits >= 4 * 5 * BLOCK  # at most two prompts' blocks were still on the device
        assert metric(text, "megatron_serve_external_prefix_cache_queries_total", engine) >= hits
        assert metric(text, "megatron_serve_kv_offload_total_bytes_total", engine + ',transfer_type="CPU_to_GPU"') > 0
        assert metric(text, "megatron_serve_kv_offload_total_bytes_total", engine + ',transfer_type="GPU_to_CPU"') > 0
        assert metric(text, "megatron_serve_kv_offload_total_time_total", engine + ',transfer_type="CPU_to_GPU"') > 0

        admin(served, "pause")
        admin(served, "refit", {"source": served.path})  # the same files, a new epoch: no tier may serve the old KV
        admin(served, "unpause")
        third = [complete(served, p) for p in prompts()]
        assert cached(third) == [0] * 6
        assert [choice(a) for a in third] == [choice(a) for a in first]

    with fleet(tiny_model, tmp_path_factory.mktemp("no-tier")) as control:
        control_first, control_second = two_passes(control)
        assert [choice(a) for a in control_first] == [choice(a) for a in first]
        assert sum(cached(control_second)) <= 2 * 5 * BLOCK  # what the device pool still held


def stream_through_the_verbs(served: SimpleNamespace, prompt: list[int], max_tokens: int, verbs) -> list[str]:
    """Stream a completion; once it has text, run ``verbs`` while it is in flight; return its pieces of text."""
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    pieces: list[str] = []
    with served.http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                break
        verbs()
        for line in lines:
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return pieces


def test_a_stream_through_pause_suspend_keep_kv_resume_unpause_computes_nothing_twice(tiny_model, tmp_path_factory):
    rng = random.Random(9)
    fresh = [[rng.randrange(5, 500) for _ in range(40)] for _ in range(2)]  # never seen: no prefix to find
    tokens = 600
    with fleet(tiny_model, tmp_path_factory.mktemp("keep-kv"), "--kv-offloading-size", "0.01",
               "--num-kv-blocks", "64") as served:  # the last one given wins
        start = metric(counters_after(served, 0), "megatron_serve_engine_computed_tokens")
        uninterrupted = complete(served, fresh[0], tokens)
        after_first = metric(counters_after(served, tokens), "megatron_serve_engine_computed_tokens")

        acks: dict[str, dict] = {}

        def verbs() -> None:
            acks["pause"] = admin(served, "pause", {"mode": "keep"})
            acks["in_flight"] = served.http.get("/v1/admin/status", headers=ADMIN).json()["in_flight"]
            acks["suspend"] = admin(served, "suspend", {"level": 1, "keep_kv": True})
            acks["resume"] = admin(served, "resume")
            acks["unpause"] = admin(served, "unpause")

        pieces = stream_through_the_verbs(served, fresh[1], tokens, verbs)
        assert acks["suspend"]["state"] == "SUSPENDED" and acks["unpause"]["state"] == "RUNNING"
        assert acks["in_flight"] == 1  # the stream was paused in flight, not finished
        after_second = metric(counters_after(served, 2 * tokens), "megatron_serve_engine_computed_tokens")
        assert after_second - after_first == after_first - start  # the same work as an uninterrupted request
        reference = complete(served, fresh[1], tokens)  # the same prompt again, uninterrupted
        assert "".join(pieces) == reference["choices"][0]["text"]
        assert uninterrupted["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"] == tokens
