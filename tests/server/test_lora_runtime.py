"""LoRA adapters loaded and unloaded while a real fleet serves (``megatron-serve run``: coordinator, two engine
processes, HTTP server), through vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` and the
official ``openai`` client; the tests run in file order on one run.

What is held: a request that runs while its adapter is unloaded, and one that runs while another adapter
is loaded, finish with the tokens they get on a quiet fleet; every bad adapter is refused with its reason
and nothing changes on any engine; ``/v1/models`` follows; a request naming an adapter only one engine
serves goes to that engine; ``/metrics`` exports ``vllm:lora_requests_info`` and the load time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import until
from ..lora_adapters import make_peft_adapter
from .conftest import metric, runtime_lora_run

pytestmark = [pytest.mark.timeout(600), pytest.mark.asyncio]

ADMIN_KEY = "lora-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "The adapters of this fleet"
LONG = 300  # tokens: a stream that seldom ends between its first token and the pause that holds it (3-4 chunks)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-adapters")
    other_model = make_tiny_model(root / "wider-model", seed=1, hidden_size=96)
    return {"a": str(make_peft_adapter(tiny_model, root / "a", rank=8, seed=1)),
            "b": str(make_peft_adapter(tiny_model, root / "b", rank=4, seed=2)),
            "c": str(make_peft_adapter(tiny_model, root / "c", rank=4, seed=3)),
            "big": str(make_peft_adapter(tiny_model, root / "big", rank=32, seed=4)),
            "head": str(make_peft_adapter(tiny_model, root / "head", rank=4, seed=5, targets=["lm_head"])),
            "wider": str(make_peft_adapter(other_model, root / "wider", rank=4, seed=6))}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, adapters):
    with runtime_lora_run(tiny_model, tmp_path_factory.mktemp("lora"), ADMIN_KEY, "--max-loras", "2", "--routing",
                          "round_robin", "--lora-allowed-dirs", str(Path(adapters["a"]).parent), engines=2) as run:
        yield run


@pytest.fixture
async def clients(stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            yield client, http
        finally:
            await client.close()


async def text(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> str:
    answer = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                             extra_body={"ignore_eos": True})
    return answer.choices[0].text


async def models(client: openai.AsyncOpenAI) -> dict[str, openai.types.Model]:
    return {m.id: m for m in (await client.models.list()).data}


async def served(http: httpx.AsyncClient) -> list[dict]:
    return [engine["loras"] for engine in (await http.get("/v1/admin/status", headers=ADMIN)).json()["engines"]]


@contextlib.asynccontextmanager
async def paused(http: httpx.AsyncClient) -> AsyncIterator[None]:
    """The fleet paused for the block and unpaused after it, also when an assertion fails inside (a fleet left
    paused would hold every later request of the module until its timeout)."""
    assert (await http.post("/v1/admin/pause", json={}, headers=ADMIN)).status_code == 200
    try:
        yield
    finally:
        assert (await http.post("/v1/admin/unpause", json={}, headers=ADMIN)).status_code == 200


async def in_flight(http: httpx.AsyncClient) -> int:
    """Requests on the fleet's engines now: with the fleet paused, they stay there until it is unpaused, so a
    verb run meanwhile is acknowledged with them in flight however slowly a loaded machine serves it."""
    return (await http.get("/v1/admin/status", headers=ADMIN)).json()["in_flight"]


class Stream:
    """A streamed completion consumed in the background: its text, and whether it ended."""

    def __init__(self, client: openai.AsyncOpenAI, model: str, max_tokens: int) -> None:
        self.text, self.chunks = "", 0
        self.first = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(client, model, max_tokens))

    async def _run(self, client: openai.AsyncOpenAI, model: str, max_tokens: int) -> str | None:
        stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        reason = None
        async for chunk in stream:
            self.text += chunk.choices[0].text
            self.chunks += 1
            self.first.set()
            reason = chunk.choices[0].finish_reason or reason
        return reason


@contextlib.asynccontextmanager
async def paused_with_one_running(client: openai.AsyncOpenAI, http: httpx.AsyncClient,
                                  model: str) -> AsyncIterator[Stream]:
    """The fleet paused with one streamed request of ``model`` on an engine, yielded. The pause is asked for at
    the stream's first token; on a loaded machine the stream can still end before the pause reaches the engines
    (CI saw it once), and then a fresh stream is tried: that the request is in flight when the verb runs is what
    the test arranges, not what it asserts."""
    for _ in range(5):
        running = Stream(client, model, LONG)
        await asyncio.wait_for(running.first.wait(), 60)
        async with paused(http):
            if await in_flight(http) == 1:
                yield running
                return
        assert await asyncio.wait_for(running.task, 120) == "length", "a stream left the fleet unfinished"
    raise AssertionError("five streams each ended before the fleet's pause reached it")


async def test_load_while_serving_lists_the_adapter_and_serves_it(stack, clients, adapters):
    client, http = clients
    base = await text(client, stack.model, LONG)
    assert set(await models(client)) == {stack.model}
    async with paused_with_one_running(client, http, stack.model) as running:
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]},
                                 headers=ADMIN)
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'a' added successfully.")
        assert not running.task.done(), "the base request was still running when the load was acknowledged"
    assert await asyncio.wait_for(running.task, 120) == "length" and running.text == base  # untouched by the load
    listed = await models(client)
    assert (listed["a"].parent, listed["a"].root) == (stack.model, adapters["a"])
    assert await served(http) == [{"a": adapters["a"]}] * 2
    tuned = await text(client, "a", 16)
    assert tuned != await text(client, stack.model, 16), "control: the adapter changes the answer"


@pytest.mark.parametrize("name,why", [
    ("missing", "missing' does not exist"),
    ("big", "rank 32 is above --max-lora-rank 16"),
    ("head", "target_modules ['lm_head'] are not supported"),
    ("wider", "the base model needs"),
    ("a", "'a' is already loaded"),
])
async def test_a_bad_adapter_is_refused_and_nothing_changes(stack, clients, adapters, name, why):
    client, http = clients
    before = (await served(http), set(await models(client)))
    path = adapters.get(name, str(Path(adapters["a"]).parent / "missing"))
    refused = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=ADMIN)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "lora_refused" and why in error["message"] and "no engine serves it" in error["message"]
    assert (await served(http), set(await models(client))) == before


async def test_the_routes_need_the_admin_key_and_check_their_bodies(stack, clients):
    _, http = clients
    body = {"lora_name": "x", "lora_path": "/x"}
    unkeyed = await http.post("/v1/load_lora_adapter", json=body)  # no key presented: 401 asks for it
    assert unkeyed.status_code == 401 and unkeyed.json()["error"]["code"] == "admin_key_required"
    wrong = await http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_admin_key"
    unknown = await http.post("/v1/load_lora_adapter", json={**body, "rank": 4}, headers=ADMIN)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "rank"
    inplace = await http.post("/v1/load_lora_adapter", json={**body, "load_inplace": True}, headers=ADMIN)
    assert inplace.status_code == 400 and "load_inplace is not supported" in inplace.json()["error"]["message"]
    missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"


async def test_unload_with_requests_in_flight_lets_them_finish_under_the_adapter(stack, clients):
    client, http = clients
    quiet = await text(client, "a", LONG)
    async with paused_with_one_running(client, http, "a") as running:
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=ADMIN)
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'a' removed successfully.")
        assert not running.task.done(), "the adapter's request was still running when the unload was acknowledged"
    assert await asyncio.wait_for(running.task, 120) == "length" and running.text == quiet
    assert set(await models(client)) == {stack.model} and await served(http) == [{}, {}]
    with pytest.raises(openai.NotFoundError):
        await text(client, "a", 4)


async def test_a_request_goes_to_the_engine_serving_its_adapter(stack, clients, adapters):
    """A ``LoRARequest`` registers its adapter on the engine it reaches; later requests that only name it can
    run nowhere else (round-robin routing would send every other one to the engine without it)."""
    async with InferenceClient(stack.coordinator(), stack.secret()) as fleet:
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
        first = await fleet.add_request(PROMPT, msgspec.structs.replace(params, lora_name="c",
                                                                        lora_path=adapters["c"]))
        assert first.error is None

        async def reported() -> bool:
            engines = (await fleet.status())["engines"]
            return sorted(bool(engine["loras"]) for engine in engines) == [False, True]

        await until(reported, 30, "one engine reporting adapter c")
        named = msgspec.structs.replace(params, lora_name="c")
        results = [await fleet.add_request(PROMPT, named) for _ in range(4)]
        assert [r.error for r in results] == [None] * 4
        assert all(r.generated_tokens == first.generated_tokens for r in results)


async def test_metrics_export_the_adapters_and_the_load_time(stack, clients, adapters):
    _, http = clients
    assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]},
                            headers=ADMIN)).status_code == 200

    async def loads_reported() -> str | None:  # engine metrics travel with heartbeats (each second)
        exposed = (await http.get("/metrics")).text
        loads = sum(metric(exposed, "megatron_serve_lora_adapter_load_seconds_count",
                           f'engine_group="{group}",model_name="{stack.model}"') for group in (0, 1))
        return exposed if loads == 4 else None  # a and b, on each engine (c was a LoRARequest's, refusals none)

    exposed = await until(loads_reported, 30, "both loads on both engines in /metrics")
    (line,) = [row for row in exposed.splitlines() if row.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="4"' in line and 'running_lora_adapters=""' in line and float(line.split()[-1]) > 1.7e9
    output = stack.control("unload_lora", "--lora-name", "b")
    assert "LoRA adapter 'b' unloaded" in output


async def test_the_routes_are_off_without_vllms_environment_variable(tokenizer, monkeypatch):
    from megatron_serve.server import create_app  # noqa: PLC0415

    from .conftest import serving  # noqa: PLC0415
    from .fakes import FakeBackend  # noqa: PLC0415

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = create_app(FakeBackend(tokenizer), tokenizer, "tiny-llama", admin_key=ADMIN_KEY, status_interval=0.05)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        off = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}, headers=ADMIN)
    assert off.status_code == 404 and off.json()["error"]["code"] == "runtime_lora_updating_disabled"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in off.json()["error"]["message"]
