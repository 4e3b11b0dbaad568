"""The control routes against a real fleet: ``megatron-serve run`` (coordinator, one engine process, HTTP server)
with an API key and an admin key. vLLM's ``/pause?mode=keep`` holds streams in flight and ``/resume`` finishes every
one of them, token for token; ``/sleep`` and ``/wake_up`` around streams in flight; ``/abort_requests`` ends one
stream by the ``request_id`` its client gave, with its tokens; SGLang's ``/health_generate`` and prime-rl's
``/liveness``; ``/server_info`` with what the engine reported."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import httpx
import pytest

from ...helpers import pending, run_in_pulses, while_held
from ...run_stack import child_pids, role_of
from ..conftest import served_process

pytestmark = [pytest.mark.timeout(300)]

API_KEY, ADMIN_KEY = "inference-key", "admin-key"
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: Far more than a stream runs before a verb catches it: the engine runs in pulses until every stream has its first
#: tokens, and again from the verb's arrival at the fleet until its answer (tests/helpers.py run_in_pulses, while_held)
TOKENS = 300


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    keys = {"MEGATRON_SERVE_API_KEY": API_KEY, "MEGATRON_SERVE_ADMIN_KEY": ADMIN_KEY}
    with served_process(tiny_model, tmp_path_factory.mktemp("control-run"), env={**os.environ, **keys}) as (url, run):
        engines = [pid for pid in child_pids(run.pid) if role_of(pid) == "engine"]
        assert len(engines) == 1, engines
        yield SimpleNamespace(url=url, model=os.path.basename(tiny_model), engines=engines)


@pytest.fixture(autouse=True)
def _serving_again(stack):
    """Wakes and resumes the fleet after each test, so that one failing while paused does not fail the next."""
    yield
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        http.post("/wake_up", headers=ADMIN).raise_for_status()
        http.post("/resume", headers=ADMIN).raise_for_status()


class Stream:
    """A streamed completion read in the background: its tokens so far, its finish reason, its usage."""

    def __init__(self, http: httpx.AsyncClient, model: str, prompt: str, request_id: str | None = None) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "stream": True, "temperature": 0.0,
                "ignore_eos": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if request_id is not None:
            body["request_id"] = request_id
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.usage: dict | None = None
        self.task = asyncio.create_task(self._read(http, body))

    async def _read(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/v1/completions", json=body, headers=API) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk["choices"]:
                    self.tokens += chunk["choices"][0].get("token_ids") or []
                    self.finish = chunk["choices"][0]["finish_reason"] or self.finish
                self.usage = chunk.get("usage") or self.usage

    async def done(self) -> "Stream":
        await asyncio.wait_for(self.task, 120)
        return self


def admin_status(http: httpx.AsyncClient):
    """The coordinator's STATUS_REPLY through the server's admin route (for :func:`~tests.helpers.pending`)."""
    async def status() -> dict:
        return (await http.get("/v1/admin/status", headers=ADMIN)).json()
    return status


async def _held(streams: list[Stream]) -> list[int]:
    """The streams' token counts, once they stood still for a while (a paused fleet sends nothing more)."""
    counts = [len(s.tokens) for s in streams]
    while True:
        await asyncio.sleep(0.5)
        now = [len(s.tokens) for s in streams]
        if now == counts:
            return now
        counts = now


async def test_pause_keep_holds_streams_in_flight_and_resume_finishes_every_one(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        streams = [Stream(http, stack.model, prompt) for prompt in ("Once upon a time", "In a galaxy", "The cat")]
        await run_in_pulses(stack.engines, lambda: all(s.tokens for s in streams), "every stream's first tokens")
        paused = await while_held(stack.engines, http.post("/pause?mode=keep", headers=ADMIN),
                                  pending(admin_status(http), "PAUSE"))
        assert paused.json() == {"status": "paused"}
        assert (await http.get("/is_paused", headers=API)).json() == {"is_paused": True}
        held = await _held(streams)
        assert all(0 < count < TOKENS for count in held) and not any(s.task.done() for s in streams), held
        assert (await http.post("/resume", headers=ADMIN)).json() == {"status": "resumed"}
        for stream in streams:
            await stream.done()
            assert stream.finish == "length" and len(stream.tokens) == TOKENS == stream.usage["completion_tokens"]


async def test_sleep_and_wake_up_around_streams_in_flight(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        streams = [Stream(http, stack.model, prompt) for prompt in ("A long road", "Under the sea")]
        await run_in_pulses(stack.engines, lambda: all(s.tokens for s in streams), "every stream's first tokens")
        asleep = await while_held(stack.engines, http.post("/sleep?level=1&mode=keep", headers=ADMIN),
                                  pending(admin_status(http), "PAUSE"))  # its first verb
        assert asleep.status_code == 200
        assert (await http.get("/is_sleeping", headers=API)).json() == {"is_sleeping": True}
        status = (await http.get("/v1/admin/status", headers=ADMIN)).json()
        assert status["state"] == "SUSPENDED" and status["suspend_level"] == 2
        held = await _held(streams)
        assert all(count < TOKENS for count in held), held
        assert (await http.post("/wake_up?tags=weights&tags=kv_cache", headers=ADMIN)).status_code == 200
        assert (await http.get("/is_sleeping", headers=API)).json() == {"is_sleeping": False}
        for stream in streams:
            await stream.done()
            assert stream.finish == "length" and len(stream.tokens) == TOKENS


async def test_abort_requests_ends_one_stream_by_its_request_id_with_its_tokens(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        cut, kept = Stream(http, stack.model, "Cut short", "rollout-1"), Stream(http, stack.model, "Kept on")
        await run_in_pulses(stack.engines, lambda: bool(cut.tokens and kept.tokens), "both streams' first tokens")
        answer = await while_held(stack.engines, http.post("/abort_requests", json={"request_ids": ["rollout-1"]},
                                                           headers=ADMIN), lambda: False)  # held once answered
        assert answer.json() == {"status": "aborted", "aborted": 1}
        await cut.done()
        assert cut.finish == "abort" and 0 < len(cut.tokens) < TOKENS == len((await kept.done()).tokens)
        assert cut.usage["completion_tokens"] == len(cut.tokens)


async def test_probes_and_server_info_read_the_real_fleet(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        assert (await http.get("/health_generate")).status_code == 200
        assert (await http.get("/liveness")).json() == {"status": "ok"}
        info = (await http.get("/server_info?config_format=json", headers=API)).json()
        assert info["vllm_config"]["model_config"]["dtype"] == "float32"  # the engine's, on a CPU
        assert info["vllm_config"]["model_config"]["max_model_len"] > 0 and info["tp_size"] == 1
        assert (await http.get("/get_world_size", headers=API)).json() == {"world_size": 1}
