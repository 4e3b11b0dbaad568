"""The host KV tier and suspend with keep_kv over a real ``megatron-serve run`` (coordinator, engine process, HTTP).

The device pool (24 blocks of 16 tokens) is smaller than the working set (six prompts of five cacheable blocks):
sent again, the prompts find their prefixes in the host tier with texts and log probs ``==`` the first pass
under ``--batch-invariant``; the same engine without a tier (its settings, in this process: direct mode) finds few;
after a refit none, and after vLLM's ``/reset_prefix_cache`` none either.

One more fleet with a tier (``kept``, the module's) serves the rest. A stream in flight through pause, suspend
with ``keep_kv``, resume and unpause ends as an uninterrupted one (texts and log probs ``==``), and the engines
compute no token of it twice (``megatron_serve_engine_computed_tokens``); with a refit in between, the stream's
context is computed again under the new epoch. The RL loop of docs/kv-tiers.md, run as the page shows it, cuts a
partial rollout, suspends the fleet (its device pool, and the rollout's blocks with it, go to the host tier) and
continues the rollout from its token ids: every complete block comes back from the host tier, and its tokens are
an uninterrupted rollout's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from megatron_serve.tokenizer import Tokenizer

from .conftest import admin_run, metric, surface

pytestmark = [pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BLOCK = 16
ENGINE = 'engine_group="0",model_name="{model}"'


#: :func:`fleet`'s engine settings (its flags), as ``InferenceConfig`` fields
ENGINE_SETTINGS = {"num_kv_blocks": 24, "block_size_tokens": BLOCK, "max_requests": 2, "batch_invariant": True}


@contextmanager
def fleet(model: str, log_dir, *extra: str) -> Iterator[SimpleNamespace]:
    """A batch-invariant ``run`` with a small pool (24 blocks of BLOCK tokens, two sequences), the admin key."""
    with admin_run(model, log_dir, ADMIN_KEY, "--num-kv-blocks", "24", "--block-size", str(BLOCK), "--max-num-seqs",
                   "2", "--batch-invariant", *extra, env=os.environ) as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            yield SimpleNamespace(http=http, model=os.path.basename(model), path=model, url=url)


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


async def two_passes_without_a_tier(model: str) -> tuple[list[dict], list[dict]]:
    """:func:`two_passes` on one engine of :func:`fleet`'s settings without a host tier, in this process (a fleet of
    its own would add only processes to start)."""
    async with surface(model, Tokenizer.from_pretrained(model), **ENGINE_SETTINGS) as (_, http):
        passes: tuple[list[dict], list[dict]] = ([], [])
        for answers in passes:
            for prompt in prompts():
                body = {"model": os.path.basename(model), "prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "logprobs": 1, "ignore_eos": True}
                answer = await http.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                answers.append(answer.json())
    return passes


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

        # vLLM's /reset_prefix_cache (RESET_PREFIX_CACHE): the warm prefixes (control) are found nowhere after it
        assert cached([complete(served, p) for p in prompts()]) == [5 * BLOCK] * 6
        answer = served.http.post("/reset_prefix_cache", headers=ADMIN)
        assert answer.status_code == 200 and answer.json() == {"success": True}
        after = [complete(served, p) for p in prompts()]
        assert cached(after) == [0] * 6 and [choice(a) for a in after] == [choice(a) for a in first]

    control_first, control_second = asyncio.run(two_passes_without_a_tier(tiny_model))
    assert [choice(a) for a in control_first] == [choice(a) for a in first]
    assert sum(cached(control_second)) <= 2 * 5 * BLOCK  # what the device pool still held


@pytest.fixture(scope="module")
def kept(tiny_model, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A fleet with a host tier and room for a long stream (64 blocks: the last --num-kv-blocks given wins);
    ``generated`` counts the tokens its tests asked for, which its ``/metrics`` reach once the engine reported them;
    ``references`` holds uninterrupted completions (:func:`reference`)."""
    with fleet(tiny_model, tmp_path_factory.mktemp("keep-kv"), "--kv-offloading-size", "0.01",
               "--num-kv-blocks", "64") as served:
        served.generated = 0
        served.references = {}
        yield served


def stream_through_the_verbs(served: SimpleNamespace, prompt: list[int], max_tokens: int, verbs
                             ) -> tuple[str, list[float]]:
    """Stream a completion; once it has text, run ``verbs`` while it is in flight; return its text and log probs."""
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    pieces: list[str] = []
    log_probs: list[float] = []

    def take(line: str) -> bool:
        """Keep a chunk's text and log probs; True once it had text."""
        choice = json.loads(line[6:])["choices"][0]
        pieces.append(choice["text"])
        log_probs.extend((choice["logprobs"] or {}).get("token_logprobs") or [])
        return bool(choice["text"])

    with served.http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: ") and take(line):
                break
        verbs()
        for line in lines:
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                take(line)
    return "".join(pieces), log_probs


def computed(served: SimpleNamespace, more: int = 0) -> float:
    """``megatron_serve_engine_computed_tokens`` once the engine reported ``more`` tokens generated after the last
    call (``served.generated`` so far)."""
    served.generated += more
    return metric(counters_after(served, served.generated), "megatron_serve_engine_computed_tokens")


STREAMED = [random.Random(9).randrange(5, 500) for _ in range(40)]
"""The prompt the streams through the verbs continue (600 tokens): an uninterrupted completion of it is made once."""


def reference(served: SimpleNamespace, prompt: list[int], max_tokens: int) -> dict:
    """An uninterrupted completion of ``prompt`` (greedy, batch-invariant: the same every time it is asked), made once
    per fleet (600 tokens of decode fewer for each test that compares against it again)."""
    key = (tuple(prompt), max_tokens)
    if key not in served.references:
        served.references[key] = complete(served, prompt, max_tokens)
        served.generated += max_tokens
    return served.references[key]


def reset_prefix_cache(served: SimpleNamespace) -> None:
    """vLLM's ``/reset_prefix_cache``: a prompt seen before is found in no tier, and computed whole again."""
    answer = served.http.post("/reset_prefix_cache", headers=ADMIN)
    assert answer.status_code == 200 and answer.json() == {"success": True}


def test_a_stream_through_pause_suspend_keep_kv_resume_unpause_computes_nothing_twice(kept):
    tokens = 600
    reset_prefix_cache(kept)  # no prefix to find for the uninterrupted completion
    start = computed(kept)
    uninterrupted = complete(kept, STREAMED, tokens)
    kept.references[(tuple(STREAMED), tokens)] = uninterrupted
    after_first = computed(kept, tokens)
    reset_prefix_cache(kept)  # nor for the stream: it computes what the uninterrupted one did

    acks: dict[str, dict] = {}

    def verbs() -> None:
        acks["pause"] = admin(kept, "pause", {"mode": "keep"})
        acks["in_flight"] = kept.http.get("/v1/admin/status", headers=ADMIN).json()["in_flight"]
        acks["suspend"] = admin(kept, "suspend", {"level": 1, "keep_kv": True})
        acks["resume"] = admin(kept, "resume")
        acks["unpause"] = admin(kept, "unpause")

    text, log_probs = stream_through_the_verbs(kept, STREAMED, tokens, verbs)
    assert acks["suspend"]["state"] == "SUSPENDED" and acks["unpause"]["state"] == "RUNNING"
    assert sum(e.get("kept_kv_bytes", 0) for e in acks["suspend"]["detail"]["engines"].values()) > 0
    assert acks["in_flight"] == 1  # the stream was paused in flight, not finished
    after_second = computed(kept, tokens)
    assert after_second - after_first == after_first - start  # the same work as an uninterrupted request
    assert (text, log_probs) == choice(uninterrupted)  # the same prompt, uninterrupted
    assert len(log_probs) == uninterrupted["usage"]["completion_tokens"] == tokens


def test_a_refit_between_suspend_with_keep_kv_and_resume_recomputes_the_stream_s_context(kept):
    """``--kv-on-refit recompute`` (the default): the kept KV is the old epoch's, so the stream's context (its prompt
    and every token it had) is computed again; the same weights come back, so its text is an uninterrupted one's."""
    prompt, tokens = STREAMED, 600
    reset_prefix_cache(kept)  # the stream finds no prefix of it (another test may have sent it)
    start = computed(kept)

    def verbs() -> None:
        admin(kept, "pause", {"mode": "keep"})
        admin(kept, "suspend", {"level": 1, "keep_kv": True})
        admin(kept, "refit", {"source": kept.path})  # the same files, a new epoch
        admin(kept, "resume")
        admin(kept, "unpause")

    text, _ = stream_through_the_verbs(kept, prompt, tokens, verbs)
    interrupted = computed(kept, tokens) - start
    assert text == choice(reference(kept, prompt, tokens))[0]
    assert interrupted >= (len(prompt) + tokens - 1) + len(prompt)  # the prompt at least once more, the new epoch's


def documented_rl_loop(monkeypatch) -> dict:
    """The RL loop's code block of docs/kv-tiers.md, run as a module (the admin key where the page says)."""
    page = (ROOT / "docs" / "kv-tiers.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "async def rl_loop" in block]
    monkeypatch.setenv("MEGATRON_SERVE_ADMIN_KEY", ADMIN_KEY)
    namespace: dict = {"__name__": "kv_tiers_rl_loop"}
    exec(compile(code, "docs/kv-tiers.md", "exec"), namespace)  # noqa: S102 - the page's own code, under test
    return namespace


async def test_the_documented_rl_loop_continues_a_cut_rollout_from_the_host_tier(kept, monkeypatch):
    long_budget = 800  # tokens: with its 40-token prompt, 53 of the fleet's 64 blocks
    loop = documented_rl_loop(monkeypatch)
    loop["SAMPLING"] = {"temperature": 0, "ignore_eos": True}  # greedy, so that the rollout compares
    await asyncio.wait_for(loop["first_half_done"]([]), 5)  # a step without jobs ends at once (it raised)
    step = loop["rl_step"]
    cuts: list[list[dict]] = []

    async def recording_step(*args, **kwargs):
        cuts.append(await step(*args, **kwargs))
        return cuts[-1]

    loop["rl_step"] = recording_step
    rng = random.Random(12)
    short, long = ([rng.randrange(5, 500) for _ in range(40)] for _ in range(2))
    # the long budget: the cut (a pause after the short one's end) must reach the engine before the long one ends,
    # however slowly a loaded machine serves the pause (300 once finished first; then the second step had no job)
    jobs = {0: [{"prompt": short, "tokens": [], "budget": 24}, {"prompt": long, "tokens": [], "budget": long_budget}]}
    trained: list[list[dict]] = []

    def train(finished: list[dict]) -> None:
        trained.append(finished)  # no checkpoint: the next step continues under the same weights

    text = counters_after(kept, kept.generated)
    engine = ENGINE.format(model=kept.model)
    host_hits = metric(text, "megatron_serve_external_prefix_cache_hits_total", engine)
    await loop["rl_loop"](kept.url, kept.model, 2, lambda index: jobs.get(index, []), train)

    ((cut,), ()) = cuts  # the long rollout was cut at the first step's end, the second step finished it
    assert cut["finish_reason"] == "abort" and 16 <= len(cut["tokens"]) < long_budget
    assert [[(len(j["tokens"]), j["finish_reason"]) for j in step] for step in trained] == [[(24, "length")],
                                                                                            [(long_budget, "length")]]
    finished = trained[1][0]
    assert finished["tokens"][:len(cut["tokens"])] == cut["tokens"]
    # every complete block of its prompt and its tokens so far, from the host tier (the suspend freed the pool)
    kept.generated += 24 + long_budget
    text = counters_after(kept, kept.generated)
    found = metric(text, "megatron_serve_external_prefix_cache_hits_total", engine) - host_hits
    assert found == (len(long) + len(cut["tokens"]) - 1) // BLOCK * BLOCK > len(long)
    uninterrupted = await asyncio.to_thread(complete_ids, kept, long, long_budget)
    kept.generated += long_budget
    assert finished["tokens"] == uninterrupted  # the rollout is the one it would have been uncut


def complete_ids(served: SimpleNamespace, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    answer = served.http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]
