"""Scale from zero with real processes: a coordinator and ``megatron-serve server`` with no engine, a request held,
the desired-replicas hint asking for a group, then an engine started and the request answered; and the bounds (a
full queue, the timeout) answered with 503 ``no_engine`` and ``Retry-After``.

Everything is real here (the coordinator, the server, the engine as processes, the official ``openai`` client,
``/metrics`` scraped over HTTP); only the autoscaler is not: the test starts the engine itself where KEDA or an HPA
would scale the resource up on ``megatron_serve_engine_groups_wanted``.

``/ready`` on both ports (the main one and the probe port a Kubernetes readiness probe reads) follows: while holding
is on and its queue has room it is 200 with ``held`` true and ``engines`` 0 (the server takes the request; a pod that
were not Ready would get nothing from its Service, and the held path never fire), 503 once the queue is full, and
with holding off (the default) 503 without an engine, as before.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megatron_serve.http_options import WakeOptions

from ..helpers import Children, free_port, http_get, http_post, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MODEL = "tiny-llama"


def _series(url: str) -> dict[str, float]:
    """The unlabelled samples of ``/metrics``, by name."""
    text = http_get(f"{url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _server(children: Children, model: str, coordinator_port: int, *flags: str) -> str:
    port = free_port()
    server = children.spawn(["server", "--model", model, "--coordinator", f"tcp://127.0.0.1:{coordinator_port}",
                             "--host", "127.0.0.1", "--port", str(port), *flags], "server")
    url = f"http://127.0.0.1:{port}"

    def reachable() -> bool:
        children.check_running()
        try:
            return http_get(f"{url}/ready", timeout=2).json().get("coordinator_reachable") is True
        except httpx.TransportError:
            return False

    wait_until(reachable, 120, "the server to reach its coordinator", interval=0.2)
    assert server.poll() is None
    return url


def _ready(url: str) -> tuple[int, dict]:
    answer = http_get(f"{url}/ready", timeout=5)
    return answer.status_code, answer.json()


def _engineless(children: Children, model: str, *flags: str) -> tuple[int, str, str]:
    """A coordinator and a server (``flags``: the server's, a probe port added) with no engine yet: the coordinator's
    port, the server's URL and its probe port's."""
    port = free_port()
    children.coordinator(model, port)
    probe_port = free_port()
    url = _server(children, model, port, *flags, "--health-port", str(probe_port))
    return port, url, f"http://127.0.0.1:{probe_port}"


def _until_ready(url: str, status: int, held: bool, missing: list[str] | None = None) -> dict:
    """Poll ``/ready`` until it answers ``status`` with ``held`` (and, when given, names exactly ``missing``: a
    server that has not yet reached its coordinator is 503 too, for another reason). The probe port follows the
    server's stamps."""
    seen: list = []

    def matches() -> bool:
        seen[:] = _ready(url)
        named = missing is None or seen[1].get("missing") == missing
        return seen[0] == status and seen[1].get("held") is held and named

    try:
        wait_until(matches, 30, f"/ready {status} held={held} on {url}", interval=0.1)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the last answer: {seen}") from None
    return seen[1]


def _ask(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    return answer.choices[0].text


def test_a_request_to_a_fleet_with_no_engine_waits_for_the_first_one_and_is_answered(tiny_model: str, tmp_path: Path):
    children = Children(tmp_path)
    try:
        port, url, probes = _engineless(children, tiny_model, "--scale-from-zero-timeout", "240")
        for where in (url, probes):  # no engine, but the server takes requests: Ready, so its Service sends them
            body = _until_ready(where, 200, held=True)
            assert body["ready"] and body["engines"] == 0 and body["missing"] == ["engines"], body
            assert "held until one registers" in body["detail"], body
        assert _series(url)["megatron_serve_engine_groups_wanted"] == 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(_ask, url)
            wait_until(lambda: _series(url)["megatron_serve_engine_groups_wanted"] == 1, 30,
                       "the hint asking for a group")
            assert _series(url)["megatron_serve_requests_waiting_for_engine"] == 1
            assert not held.done()
            started = time.monotonic()
            children.engine(tiny_model, port)  # what the autoscaler does on the hint
            text = held.result(timeout=300)
            woke = time.monotonic() - started
        for where in (url, probes):
            body = _until_ready(where, 200, held=False)
            assert body["engines"] == 1 and body["missing"] == [] and body["detail"] is None, body
        series = _series(url)
        print(f"wake from zero: engine process start -> the held request answered in {woke:.1f}s; "
              f"the server's megatron_serve_wake_seconds {series['megatron_serve_wake_seconds_sum']:.1f}s")
        assert series["megatron_serve_wake_seconds_count"] == 1
        assert series["megatron_serve_engine_groups_wanted"] == 0
        assert series["megatron_serve_requests_waiting_for_engine"] == 0
        assert text and _ask(url) == text  # greedy: the held request's answer is the engine's uninterrupted one
    finally:
        children.kill_all()


def test_past_the_queue_or_the_timeout_a_waiting_request_gets_503_no_engine_with_retry_after(tiny_model: str,
                                                                                             tmp_path: Path):
    children = Children(tmp_path)
    port = free_port()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    try:
        children.coordinator(tiny_model, port)
        url = _server(children, tiny_model, port, "--scale-from-zero-timeout", "3", "--scale-from-zero-queue", "1")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            began = time.monotonic()
            first = pool.submit(http_post, f"{url}/v1/completions", json=body, timeout=60)
            wait_until(lambda: _series(url)["megatron_serve_requests_waiting_for_engine"] == 1, 30, "one waiting")
            status, ready = _ready(url)  # a request now would be refused: not ready
            assert status == 503 and not ready["ready"] and "fill the queue" in ready["detail"], ready
            full = http_post(f"{url}/v1/completions", json=body, timeout=60)  # the queue (1) is taken
            assert full.status_code == 503 and full.json()["error"]["code"] == "no_engine", full.text
            assert "--scale-from-zero-queue 1" in full.json()["error"]["message"]
            assert int(full.headers["Retry-After"]) >= 1
            late = first.result(timeout=60)
            waited = time.monotonic() - began
        assert late.status_code == 503 and late.json()["error"]["code"] == "no_engine", late.text
        assert "--scale-from-zero-timeout 3s" in late.json()["error"]["message"]
        assert int(late.headers["Retry-After"]) >= 1
        assert 3 <= waited < 30
        assert _series(url)["megatron_serve_requests_waiting_for_engine"] == 0
        assert _ready(url)[0] == 200  # room again
    finally:
        children.kill_all()


def test_with_holding_off_the_default_a_fleet_without_engines_is_not_ready(tiny_model: str, tmp_path: Path):
    """The control: without --scale-from-zero-timeout nothing is held, and /ready is 503 on both ports while no engine
    is registered (a load balancer sends nothing), as a vLLM server without an engine would be."""
    children = Children(tmp_path)
    try:
        port, url, probes = _engineless(children, tiny_model)
        for where in (url, probes):
            body = _until_ready(where, 503, held=False, missing=["engines"])
            assert "none is registered" in body["detail"], body
        assert _series(url)["megatron_serve_engine_groups_wanted"] == 0
    finally:
        children.kill_all()


@pytest.mark.parametrize(("timeout", "queue", "named"), [(-1.0, 1, "--scale-from-zero-timeout"),
                                                         (float("inf"), 1, "--scale-from-zero-timeout"),
                                                         (5.0, -1, "--scale-from-zero-queue")])
def test_bad_bounds_are_refused_by_their_flag(timeout: float, queue: int, named: str):
    with pytest.raises(ValueError, match=named):
        WakeOptions(timeout, queue)


def test_holding_is_off_by_default():
    assert not WakeOptions().enabled and WakeOptions(300.0).enabled
