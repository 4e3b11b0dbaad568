"""The official ``openai`` client, unchanged, against a real ``megatron-serve run`` on a tiny model.

One ``run`` process (coordinator + 1 engine process + HTTP server) serves the whole module on
127.0.0.1; the tests run in file order and the last two stop the fleet and then the process.
Greedy answers are compared with ``MegatronLLM`` direct mode on the same weights.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.commands import local_runs
from megatron_serve.config import InferenceConfig
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import alive, http_get, wait_until
from .conftest import metric, wait_ready

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

API_KEY = "e2e-secret"
QUEUE_LIMIT = 4
NUM_KV_BLOCKS = 256
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog."]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the weather like?"}]
MAX_TOKENS = 12


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the coordinator and engines live in their own sessions)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return children


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("run")
    port = free_port()
    output = log_dir / "run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", tiny_model, "--port", str(port),
             "--coordinator-port", "0", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-concurrent-requests",
             str(QUEUE_LIMIT), "--log-dir", str(log_dir), "--drain-timeout", "5"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "MEGATRON_SERVE_API_KEY": API_KEY})
    url = f"http://127.0.0.1:{port}"
    children: list[int] = []
    try:
        wait_ready(proc, url, output)
        text = output.read_text()
        address = re.search(r"coordinator listening on (tcp://\S+)", text).group(1)
        children = child_pids(proc.pid)
        yield SimpleNamespace(proc=proc, url=url, address=address, output=output, children=children,
                              model=Path(tiny_model).name)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def direct(tiny_model, tokenizer):
    """Greedy results of direct mode (engine in this process) for the prompts used here."""
    from megatron_serve.api.llm import MegatronLLM  # noqa: PLC0415

    llm = MegatronLLM(tiny_model, InferenceConfig(num_kv_blocks=NUM_KV_BLOCKS))
    greedy = SamplingParams(temperature=0.0, num_tokens_to_generate=MAX_TOKENS, return_log_probs=True)
    chat_tokens = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    completions = llm.generate(PROMPTS, greedy)
    (chat,) = llm.generate([chat_tokens], greedy)
    long = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, num_tokens_to_generate=40,
                                                              ignore_eos=True))[0]
    return SimpleNamespace(completions=completions, chat=chat, long=long)


def control(address: str, verb: str, **kwargs):
    """A verb to the fleet of the `run` at ``address``, with the secret that run keeps for its user."""
    async def go():
        c = InferenceClient(address, token=local_runs.secret_for(address), role="control")
        await c.start(timeout=30)
        try:
            return await getattr(c, verb)(timeout=60, **kwargs)
        finally:
            c.close()

    return asyncio.run(go())


def scrape(stack) -> str:
    return http_get(f"{stack.url}/metrics", timeout=10).text


def test_models_health_ready_and_metric_names(stack, client):
    (model,) = client.models.list().data
    assert model.id == stack.model
    assert httpx.get(f"{stack.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.url}/ready").json()
    assert ready["ready"] and ready["state"] == "RUNNING" and ready["engines"] == 1
    names = ("megatron_serve_requests_total", "megatron_serve_prompt_tokens_total",
             "megatron_serve_generation_tokens_total", "megatron_serve_time_to_first_token_seconds_bucket",
             "megatron_serve_time_per_output_token_seconds_bucket", "megatron_serve_queue_depth",
             "megatron_serve_num_requests_running", "megatron_serve_kv_blocks_used", "megatron_serve_kv_blocks_total",
             'megatron_serve_lifecycle_state{state="RUNNING"} 1.0')
    # The engines' series come with their heartbeats (once a second), which may follow /ready's first 200.
    deadline = time.monotonic() + 30
    while [name for name in names if name not in (text := scrape(stack))] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [name for name in names if name not in text] == []
    assert metric(text, "megatron_serve_kv_blocks_total") == NUM_KV_BLOCKS
    lines = stack.output.read_text().splitlines()
    assert [line[:5] for line in lines if line.startswith("[")][:4] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert any(line.startswith("megatron-serve is ready: ") and "curl " in line for line in lines)


def test_greedy_completions_equal_direct_mode(stack, client, direct, tokenizer):
    answer = client.completions.create(model=stack.model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, expected in zip(answer.choices, direct.completions):
        assert choice.text == expected.generated_text
        assert choice.finish_reason == expected.finish_reason.value
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "length":
            assert len(expected.generated_tokens) == MAX_TOKENS
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert answer.usage.completion_tokens == sum(len(r.generated_tokens) for r in direct.completions)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens

    stream = client.completions.create(model=stack.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.completions[0].generated_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == direct.completions[0].finish_reason.value
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(direct.completions[0].generated_tokens)


def test_greedy_chat_equals_direct_mode(stack, client, direct):
    answer = client.chat.completions.create(model=stack.model, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                            temperature=0)
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.chat.generated_text
    assert choice.finish_reason == direct.chat.finish_reason.value
    assert answer.usage.prompt_tokens == len(direct.chat.prompt_tokens)
    assert answer.usage.completion_tokens == len(direct.chat.generated_tokens)

    chunks = list(client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.chat.generated_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == direct.chat.finish_reason.value
    assert chunks[-1].usage.prompt_tokens == len(direct.chat.prompt_tokens)


def test_n2_choices_streamed_and_not(stack, client):
    answer = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=8, n=2,
                                       temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].text != answer.choices[1].text  # seeded per choice, not the same draw twice
    assert all(c.finish_reason == "length" for c in answer.choices)
    assert answer.usage.completion_tokens == 16
    again = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=8, n=2,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]  # a seed makes it repeatable

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=6, n=2, stream=True,
                                                temperature=0.8, seed=3, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1] and finished == {0: "length", 1: "length"}


def test_stop_sequences(stack, client, direct):
    text = direct.long.generated_text
    start = next(m.start() for m in re.finditer(r"[A-Za-z]{2,}", text) if m.start() > 0)
    stop = text[start:start + 2]
    expected = text[: text.index(stop)]
    answer = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stop=[stop], extra_body={"ignore_eos": True})
    assert answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=40,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(stack, client, direct):
    answer = client.completions.create(model=stack.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=2)
    logprobs = answer.choices[0].logprobs
    expected = direct.completions[0]
    assert len(logprobs.tokens) == len(expected.generated_tokens) == answer.usage.completion_tokens
    assert logprobs.token_logprobs == pytest.approx(expected.generated_log_probs, abs=1e-4)
    # greedy: the chosen token is the most likely one (alternatives are keyed by text, which may repeat)
    assert all(1 <= len(top) <= 2 and max(top.values()) <= lp + 1e-4
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))

    chat = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(direct.chat.generated_tokens)
    assert [c.logprob for c in content] == pytest.approx(direct.chat.generated_log_probs, abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)
               for c in content)

    # streamed: every chunk's tokens carry their alternatives, not only the last chunk's
    streamed = [c for chunk in client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                                               temperature=0, logprobs=True, top_logprobs=3,
                                                               stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in streamed)
    pieces = [chunk.choices[0].logprobs for chunk in client.completions.create(
        model=stack.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2, stream=True)
        if chunk.choices and chunk.choices[0].logprobs]
    assert sum(len(p.tokens) for p in pieces) == len(expected.generated_tokens)
    assert all(top and 1 <= len(top) <= 2 for p in pieces for top in p.top_logprobs)


def test_errors_have_status_and_openai_shape(stack, client):
    def raw(path: str, body: dict, key: str | None = API_KEY) -> dict:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(f"{stack.url}{path}", json=body, headers=headers, timeout=30)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return {"status": response.status_code, **error}

    body = {"model": stack.model, "prompt": "Hi", "max_tokens": 2}
    assert raw("/v1/completions", body, key=None)["status"] == 401
    assert raw("/v1/completions", body, key="wrong")["status"] == 401
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=stack.model, prompt=[9] * 1024, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=stack.model, messages=CHAT, temperature=3.0)
    assert info.value.param == "temperature"
    assert raw("/v1/chat/completions", {"model": stack.model, "messages": CHAT, "top_p": 0})["status"] == 400
    assert raw("/v1/completions", {**body, "max_tokens": 5000})["code"] == "context_length_exceeded"


def test_paused_and_suspended_fleets_hold_requests_and_queue_limit_is_429(stack, client, direct):
    control(stack.address, "pause")
    pool = ThreadPoolExecutor(QUEUE_LIMIT)
    try:
        held = [pool.submit(client.completions.create, model=stack.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                            temperature=0) for _ in range(QUEUE_LIMIT)]
        wait_until(lambda: metric(scrape(stack), "megatron_serve_server_pending_requests") == QUEUE_LIMIT, 30,
                   "held requests")
        text = scrape(stack)
        assert metric(text, "megatron_serve_lifecycle_state", 'state="PAUSED"') == 1
        assert metric(text, "megatron_serve_queue_depth") == QUEUE_LIMIT
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=stack.model, prompt="Hi", max_tokens=2)
        assert info.value.code == "queue_full"
        ready = httpx.get(f"{stack.url}/ready")  # paused: not ready (requests wait), right after the pause
        assert ready.status_code == 503 and ready.json()["state"] == "PAUSED", ready.text
        assert not any(f.done() for f in held)
        control(stack.address, "unpause")
        for future in held:
            assert future.result(timeout=60).choices[0].text == direct.completions[0].generated_text

        control(stack.address, "suspend")
        one = pool.submit(client.chat.completions.create, model=stack.model, messages=CHAT,
                          max_completion_tokens=MAX_TOKENS, temperature=0)
        wait_until(lambda: metric(scrape(stack), "megatron_serve_queue_depth") == 1, 30, "a held chat request")
        assert metric(scrape(stack), "megatron_serve_lifecycle_state", 'state="SUSPENDED"') == 1
        control(stack.address, "resume")
        control(stack.address, "unpause")
        assert one.result(timeout=60).choices[0].message.content == direct.chat.generated_text
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_disconnects_abort_and_free_the_request(stack):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted = metric(scrape(stack), "megatron_serve_requests_total", 'status="aborted"')
    engine = f'engine_group="0",model_name="{stack.model}"'
    body = {"model": stack.model, "prompt": "Once upon a time", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            control(stack.address, "pause")  # freeze it mid-generation, holding its KV blocks
            wait_until(lambda: metric(scrape(stack), "megatron_serve_num_requests_running", engine) == 1, 30,
                       "running request")
            assert metric(scrape(stack), "megatron_serve_kv_blocks_used") > 0
        # the client went away mid-stream: the request is aborted and the engine frees it
        wait_until(lambda: metric(scrape(stack), "megatron_serve_requests_total", 'status="aborted"') == aborted + 1,
                   30, "the abort")
        wait_until(lambda: metric(scrape(stack), "megatron_serve_kv_blocks_used") == 0
                   and metric(scrape(stack), "megatron_serve_num_requests_running", engine) == 0, 30,
                   "the engine to free it")

        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request, waiting in the paused queue
            http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=1.0)
        wait_until(lambda: metric(scrape(stack), "megatron_serve_requests_total", 'status="aborted"') == aborted + 2,
                   30, "the second abort")
        wait_until(lambda: metric(scrape(stack), "megatron_serve_queue_depth") == 0, 30, "an empty queue")
    control(stack.address, "unpause")


def counter(text: str, name: str, labels: str = "") -> float:
    """A counter's value; 0 while it has no sample (an engine's first heartbeat may carry no metrics yet)."""
    try:
        return metric(text, name, labels)
    except KeyError:
        return 0.0


def test_metrics_during_load_show_every_documented_series(stack, tiny_model):
    """Scrape /metrics before, during and after real load: every catalogued series is there and sane."""
    from megatron_serve.server.metric_catalog import SERIES, TENANT_LABELS  # noqa: PLC0415

    engine = f'engine_group="0",model_name="{stack.model}"'
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": stack.model, "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 24,
            "ignore_eos": True, "temperature": 0}
    before = scrape(stack)
    during: list[str] = []
    held_count = QUEUE_LIMIT - 1  # the server holds QUEUE_LIMIT requests: one streaming, the rest waiting
    pool = ThreadPoolExecutor(held_count)
    with httpx.Client(base_url=stack.url, headers=headers, timeout=120) as http:
        try:
            long = {**body, "stream": True, "max_tokens": 900}  # still running when the pause lands
            with http.stream("POST", "/v1/completions", json=long) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                control(stack.address, "pause")  # freeze the load mid-generation: running, holding KV blocks
                held = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(held_count)]
                wait_until(lambda: metric(scrape(stack), "megatron_serve_num_requests_running", engine) == 1
                           and metric(scrape(stack), "megatron_serve_queue_depth") == held_count, 60,
                           "a running request and a queue")
                during.append(scrape(stack))
                assert 0 < metric(during[-1], "megatron_serve_kv_cache_usage_perc", engine) <= 1
                control(stack.address, "unpause")
            # the streaming client left: its request is aborted; the held ones run to their length
            for future in held:
                assert future.result(timeout=120).status_code == 200
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    control(stack.address, "pause")  # a refit of the same weights: the refit series fill too
    control(stack.address, "refit", source=tiny_model, epoch=7)
    control(stack.address, "unpause")

    length = f'engine_group="0",finished_reason="length",model_name="{stack.model}"'  # labels sort by name
    first = counter(before, "megatron_serve_request_success_total", length)

    refit_seconds = re.compile(r'^megatron_serve_engine_refit_seconds\{[^}]*phase="total"\} ([0-9.e+-]+)$', re.M)

    def settled() -> bool:  # engines report in heartbeats: wait until the last request and the refit are counted
        during.append(scrape(stack))
        refit = refit_seconds.search(during[-1])  # the refit's figures come in a heartbeat of their own
        return (counter(during[-1], "megatron_serve_request_success_total", length) >= first + held_count
                and refit is not None and float(refit.group(1)) > 0)

    wait_until(settled, 30, "the engine counters to catch up")
    after = during.pop()
    # a counter per draft position has samples only where speculation ran (tests/commands/test_speculative_run.py),
    # the KV offload counters only where a host tier runs (tests/server/test_kv_tiers_http.py), the per-tenant
    # series only where tenants are configured (tests/server/test_tenants.py), the EPLB series only where an expert-parallel
    # group balances its experts (tests/parallel/test_expert_parallel_eplb_metrics.py), the disk tier's only where one
    # runs (tests/server/test_kv_disk_metrics.py)
    by_position = {"megatron_serve_spec_decode_num_accepted_tokens_per_pos_total",
                   "megatron_serve_kv_offload_total_bytes_total", "megatron_serve_kv_offload_total_time_total"}
    assert not re.search(r"^megatron_serve_spec_decode_num_accepted_tokens_per_pos_total\{", after, flags=re.M)
    assert not re.search(r"^megatron_serve_tenant_", after, flags=re.M)  # no tenants here: none tagged
    assert not re.search(r"^megatron_serve_eplb_", after, flags=re.M)  # no EPLB here: nothing balanced
    assert not re.search(r"^megatron_serve_kv_disk_", after, flags=re.M)  # no disk tier here
    # every other documented series has samples
    for entry in (e for e in SERIES if e.full_name not in by_position and e.labels[:2] != TENANT_LABELS
                  and not e.name.startswith(("eplb_", "kv_disk_"))):
        assert re.search(rf"^{entry.full_name}(_bucket|_count)?[{{ ]", after, flags=re.M), entry.full_name
    for text in [before, *during, after]:
        assert 0 <= metric(text, "megatron_serve_kv_cache_usage_perc", engine) <= 1
    assert metric(after, "megatron_serve_kv_cache_usage_perc", engine) == 0  # everything finished

    def grew(name: str, labels: str = engine) -> float:
        return metric(after, name, labels) - counter(before, name, labels)

    tokens = held_count * body["max_tokens"]
    assert grew("megatron_serve_generation_tokens_total") >= tokens
    assert grew("megatron_serve_prompt_tokens_total") >= QUEUE_LIMIT * 10
    assert grew("megatron_serve_request_success_total", length.replace('"length"', '"abort"')) >= 1
    assert grew("megatron_serve_prefix_cache_queries_total") >= grew("megatron_serve_prompt_tokens_total")
    assert grew("megatron_serve_prefix_cache_hits_total") > 0  # the same prompt, four times
    assert grew("megatron_serve_num_preemptions_total") >= 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"megatron_serve_{histogram}_count") >= held_count, histogram
        assert grew(f"megatron_serve_{histogram}_sum") > 0, histogram
    assert grew("megatron_serve_inter_token_latency_seconds_count") >= tokens - held_count
    assert grew("megatron_serve_refits_total", "") == 1 and metric(after, "megatron_serve_weights_epoch") == 7
    assert float(refit_seconds.search(after).group(1)) > 0


def test_stopped_fleet_answers_503(stack, client):
    control(stack.address, "stop", drain_timeout=5.0)
    wait_until(lambda: http_get(f"{stack.url}/ready").status_code == 503, 30, "not ready")
    assert httpx.get(f"{stack.url}/ready").json()["state"] == "STOPPED"
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=stack.model, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 503 and info.value.code == "fleet_stopped"


def test_sigint_stops_everything(stack):
    assert stack.children and all(alive(pid) for pid in stack.children[:1])  # the coordinator at least
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=60) == 130  # the shell's code for an interrupt
    wait_until(lambda: not any(alive(pid) for pid in stack.children), 30, "children to exit")
    assert "stopped" in stack.output.read_text().splitlines()[-1]
