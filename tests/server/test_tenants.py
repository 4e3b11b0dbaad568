"""Tenants at the server (docs/tenants.md): the key document, whose a request is (its key, else the fairness id a
gateway sets), the tag its engine requests carry, limits answered 429 with a ``Retry-After`` that works when
honoured, and ``sheddable`` requests shed with 503 while the fleet is saturated, never ``critical`` ones.

Over the fake backend (no model): the budgets run on a clock of the test's, so a ``Retry-After`` is honoured by
moving the clock, not by sleeping. The scheduling itself (bands, fair shares, preemption) is tested at the
coordinator (tests/coordinator/test_fair_queue.py) and the engine (tests/engine/test_tenancy_scheduler.py), and
end to end in tests/server/test_tenants_e2e.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from megatron_serve.server import create_app
from megatron_serve.server.tenant_budgets import RateBucket
from megatron_serve.http_options import FAIRNESS_HEADER, Shedding
from megatron_serve.server.tenants import (DEFAULT_TENANT, TenancyOptions, TenantConfigError, is_document,
                                           parse_document, tenant_table)
from megatron_serve.wire.tenancy import TenantTag

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

DOCUMENT = """
# the keys of three teams and a gateway
tenants:
  team-a: {class: critical, weight: 3, requests_per_minute: 2}
  batch: {class: sheddable}
  default: {class: standard, tokens_per_minute: 600}
keys:
  - {key: key-a, tenant: team-a}
  - {key_env: BATCH_KEY, tenant: batch}
  - {key: key-b, tenant: team-b, class: standard, weight: 1, max_concurrent: 1}
  - {key: key-gateway}
"""
ENV = {"BATCH_KEY": "key-batch"}


class Clock:
    """A clock of the test's (the budgets' and the refusal pace's): time moves when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_document_names_tenants_with_their_class_weight_and_limits():
    table = parse_document(DOCUMENT, ENV)
    a = table.tenant(table.entry(b"key-a"), None)
    assert (a.name, a.priority_class, a.weight, a.limits.requests_per_minute) == ("team-a", "critical", 3.0, 2)
    assert a.tag == TenantTag("team-a", "critical", 3.0)
    assert table.tenant(table.entry(b"key-batch"), None).priority_class == "sheddable"
    b = table.tenant(table.entry(b"key-b"), None)
    assert (b.name, b.limits.max_concurrent) == ("team-b", 1)
    assert table.entry(b"key-c") is None and table.entry(b"") is None
    # a key's tenant is never moved by the header; a key without one takes it, else the anonymous tenant
    assert table.tenant(table.entry(b"key-a"), "team-x").name == "team-a"
    gateway = table.entry(b"key-gateway")
    assert table.tenant(gateway, None).name == DEFAULT_TENANT
    named = table.tenant(gateway, "user-7")
    assert (named.name, named.priority_class, named.limits.tokens_per_minute) == ("user-7", "standard", 600)
    assert table.tenant(gateway, "batch").priority_class == "sheddable"  # a named tenant's own entry
    assert is_document(DOCUMENT) and is_document(json.dumps({"keys": []})) and not is_document("sk-plain-key")


@pytest.mark.parametrize("text, words", [
    ("tenants: {a: {class: urgent}}\nkeys: []", "class must be one of critical, standard, sheddable"),
    ("tenants: {a: {weight: 0}}\nkeys: []", "weight must be a positive number"),
    ("tenants: {a: {tokens_per_minute: 1.5}}\nkeys: []", "tokens_per_minute must be a whole number"),
    ("tenants: {a: {colour: red}}\nkeys: []", "unknown settings ['colour']"),
    ("tenants: {}", "lists no keys"),
    ("keys: [{tenant: a}]", "exactly one of key, key_file, key_env"),
    ("keys: [{key: k, key_env: K}]", "exactly one of key, key_file, key_env"),
    ("keys: [{key_env: NOPE}]", "$NOPE is not set"),
    ("keys: [{key: k}, {key: k}]", "repeats a key"),
    ("keys: [{key: k, class: critical}]", "settings without a tenant"),
    ("tenants: {a: {}}\nkeys: [{key: k, tenant: a, weight: 2}]", "give them in one place"),
    ("keys: [{key: k, tenant: a, weight: 2}, {key: j, tenant: a, weight: 3}]", "other settings on an earlier key"),
    ("keys: {a: b}", "keys must be a list"),
    ("limits: {}\nkeys: []", "unknown sections ['limits']"),
])
def test_a_bad_document_is_refused_naming_what_is_wrong(text, words):
    with pytest.raises(TenantConfigError) as refused:
        parse_document(text, {})
    assert words in str(refused.value)


def test_without_a_document_tenants_are_off_unless_the_header_is_asked_for():
    assert tenant_table("sk-plain", None) is None and tenant_table(None, TenancyOptions()) is None
    table = tenant_table("sk-plain", TenancyOptions(header="x-team"))
    assert table is not None and table.entry(b"sk-plain") is not None and table.entry(b"other") is None
    assert table.tenant(table.entry(b"sk-plain"), "t1").name == "t1"
    assert TenancyOptions().header_name == FAIRNESS_HEADER and TenancyOptions(header="").header_name is None


def test_a_bucket_holds_a_minute_and_says_when_a_cost_fits():
    bucket = RateBucket(60, now=0.0)
    assert bucket.wait(60, 0.0) == 0
    bucket.take(60)
    assert bucket.wait(1, 0.0) == pytest.approx(1.0) and bucket.wait(30, 0.0) == pytest.approx(30.0)
    assert bucket.wait(30, 30.0) == 0
    bucket.give(100, 30.0)
    assert bucket.level == 60  # never above a minute's worth


def app_with(tokenizer, backend, document: str = DOCUMENT, **options):
    app = create_app(backend, tokenizer, "tiny-llama", api_key=document, vocab_size=512, max_model_len=1024,
                     status_interval=0.05, tenancy=TenancyOptions(**options))
    clock = Clock()
    tenancy = app.state.ctx.tenancy
    tenancy.clock = clock  # the budgets' clock; the fleet status's age is the monitor's own
    return app, clock


def body(max_tokens: int = 4, **extra) -> dict:
    return {"model": "tiny-llama", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0, **extra}


def bearer(key: str, **headers: str) -> dict:
    return {"Authorization": f"Bearer {key}", **headers}


async def test_each_key_is_its_tenant_and_its_requests_carry_the_tag(tokenizer, monkeypatch):
    monkeypatch.setenv("BATCH_KEY", "key-batch")
    backend = FakeBackend(tokenizer)
    app, clock = app_with(tokenizer, backend)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/v1/completions", json=body())).status_code == 401
        assert (await http.post("/v1/completions", json=body(), headers=bearer("nope"))).status_code == 401
        for key, headers in (("key-a", {FAIRNESS_HEADER: "someone"}), ("key-batch", {}),
                             ("key-gateway", {FAIRNESS_HEADER: "user-7"}), ("key-gateway", {})):
            answer = await http.post("/v1/completions", json=body(n=2), headers=bearer(key, **headers))
            assert answer.status_code == 200, answer.text
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        clock.now += 30  # team-a's n=2 spent its 2 requests a minute (engine requests count); 30 s gives one back
        assert (await http.post("/v1/chat/completions", json=chat, headers=bearer("key-a"))).status_code == 200
        bad = await http.post("/v1/completions", json=body(), headers=bearer("key-gateway", **{FAIRNESS_HEADER: "x" * 200}))
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_tenant"
        metrics = (await http.get("/metrics")).text
    tags = [params.tenant for _, params in backend.submitted]
    assert tags == [TenantTag("team-a", "critical", 3.0)] * 2 + [TenantTag("batch", "sheddable", 1.0)] * 2 + [
        TenantTag("user-7", "standard", 1.0)] * 2 + [TenantTag("default", "standard", 1.0)] * 2 + [
        TenantTag("team-a", "critical", 3.0)]
    assert 'megatron_serve_tenant_requests_total{priority_class="critical",tenant="team-a"} 3.0' in metrics
    assert 'megatron_serve_tenant_generation_tokens_total{priority_class="sheddable",tenant="batch"} 8.0' in metrics
    assert 'megatron_serve_tenant_request_queue_time_seconds_count{priority_class="standard",tenant="user-7"} 2.0' \
        in metrics


async def test_without_tenants_nothing_is_tagged(tokenizer):
    backend = FakeBackend(tokenizer)
    app = create_app(backend, tokenizer, "tiny-llama", api_key="sk-plain", vocab_size=512, max_model_len=1024,
                     status_interval=0.05)
    assert app.state.ctx.tenancy is None
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        answer = await http.post("/v1/completions", json=body(), headers=bearer("sk-plain", **{FAIRNESS_HEADER: "t"}))
        assert answer.status_code == 200
        assert "tenant_" not in (await http.get("/metrics")).text
    assert [params.tenant for _, params in backend.submitted] == [None]


async def test_over_a_limit_a_429_whose_retry_after_honoured_succeeds(tokenizer):
    backend = FakeBackend(tokenizer, max_sequence_length=1024)
    app, clock = app_with(tokenizer, backend, document=DOCUMENT.replace("key_env: BATCH_KEY", "key: key-batch"))
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        # requests_per_minute 2: two go, the third waits for one to refill (30 s)
        for _ in range(2):
            assert (await http.post("/v1/completions", json=body(), headers=bearer("key-a"))).status_code == 200
        refused = await http.post("/v1/completions", json=body(), headers=bearer("key-a"))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["Retry-After"] == "30" and "requests_per_minute" in refused.json()["error"]["message"]
        clock.now += 29
        assert (await http.post("/v1/completions", json=body(), headers=bearer("key-a"))).status_code == 429
        clock.now += 1
        assert (await http.post("/v1/completions", json=body(), headers=bearer("key-a"))).status_code == 200
        # tokens_per_minute 600 (the default tenant's, per fairness id): the prompt and max_tokens are reserved,
        # what is not generated comes back when the request ends
        gateway = bearer("key-gateway", **{FAIRNESS_HEADER: "user-9"})
        assert (await http.post("/v1/completions", json=body(max_tokens=500), headers=gateway)).status_code == 200
        refused = await http.post("/v1/completions", json=body(max_tokens=500), headers=gateway)
        assert refused.status_code == 429 and "tokens_per_minute" in refused.json()["error"]["message"]
        clock.now += int(refused.headers["Retry-After"])
        assert (await http.post("/v1/completions", json=body(max_tokens=500), headers=gateway)).status_code == 200
        too_big = await http.post("/v1/completions", json=body(max_tokens=700), headers=gateway)
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "over_tenant_limit"
        other = bearer("key-gateway", **{FAIRNESS_HEADER: "user-10"})  # a budget of its own
        assert (await http.post("/v1/completions", json=body(max_tokens=500), headers=other)).status_code == 200
        metrics = (await http.get("/metrics")).text
    assert ('megatron_serve_tenant_requests_refused_total{priority_class="critical",reason="requests_per_minute",'
            'tenant="team-a"} 2.0') in metrics


async def test_max_concurrent_refuses_a_second_request_while_the_first_runs(tokenizer):
    backend = FakeBackend(tokenizer)
    backend.gate.clear()  # the first request waits in the fleet
    app, _ = app_with(tokenizer, backend, document=DOCUMENT.replace("key_env: BATCH_KEY", "key: key-batch"))
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        import asyncio

        first = asyncio.ensure_future(http.post("/v1/completions", json=body(), headers=bearer("key-b")))
        while not backend.submitted:
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/completions", json=body(), headers=bearer("key-b"))
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        backend.gate.set()
        assert (await first).status_code == 200
        assert (await http.post("/v1/completions", json=body(), headers=bearer("key-b"))).status_code == 200


FAN_OUT = """
tenants:
  bulk: {class: standard, max_concurrent: 4, requests_per_minute: 10}
keys:
  - {key: key-bulk, tenant: bulk}
"""


async def test_every_tenant_limit_counts_engine_requests_prompts_times_n(tokenizer):
    """Issue 86: a request of 160,000 engine requests counted as one against max_concurrent 64. Now 2 prompts x n 2
    hold 4 of max_concurrent 4 and take 4 of requests_per_minute 10; more than a limit could ever hold is a 400
    naming it."""
    backend = FakeBackend(tokenizer)
    backend.gate.clear()  # the first request's engine requests wait in the fleet
    app, clock = app_with(tokenizer, backend, document=FAN_OUT)
    key = bearer("key-bulk")
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        import asyncio

        never = await http.post("/v1/completions", json=body(prompt=["a", "b", "c"], n=2), headers=key)
        assert never.status_code == 400 and never.json()["error"]["code"] == "over_tenant_limit"
        assert "asks for 6 engine requests (prompts x n)" in never.json()["error"]["message"]
        assert "max_concurrent of 4" in never.json()["error"]["message"]
        first = asyncio.ensure_future(http.post("/v1/completions", json=body(prompt=["a", "b"], n=2), headers=key))
        while len(backend.submitted) < 4:
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/completions", json=body(), headers=key)
        assert refused.status_code == 429 and "max_concurrent (4 engine requests in progress)" in refused.text
        backend.gate.set()
        assert (await first).status_code == 200
        assert (await http.post("/v1/completions", json=body(n=4), headers=key)).status_code == 200
        refused = await http.post("/v1/completions", json=body(n=4), headers=key)  # 8 of 10 taken this minute
        assert refused.status_code == 429 and "requests_per_minute" in refused.text
        clock.now += int(refused.headers["Retry-After"])
        assert (await http.post("/v1/completions", json=body(n=4), headers=key)).status_code == 200
    assert len(backend.submitted) == 12


class SaturatedBackend(FakeBackend):
    """Its one engine has ``waiting`` requests queued and ``used`` of 64 KV blocks in use; ``stalled``: its status
    polls time out on a connection that still hears the coordinator (busy: the last status stands and ages)."""

    waiting = 0
    used = 0
    stalled = False

    async def status(self, timeout: float | None = 10.0) -> dict:
        if self.stalled:
            self.connected = True
            raise TimeoutError("no status in time")
        status = await super().status(timeout)
        status["engines"][0].update(waiting=self.waiting, kv_blocks_free=64 - self.used)
        return status


async def test_a_fresh_status_is_not_stale_whatever_the_budgets_clock_reads(tokenizer):
    """The control for the status's age: measured on the budgets' clock (an hour ahead of the monitor's here, a few
    minutes on a freshly booted host before), a status polled a moment ago counted as stale and a fresh fleet shed
    its first sheddable request with 503 fleet_saturated."""
    app, clock = app_with(tokenizer, SaturatedBackend(tokenizer),
                          document=DOCUMENT.replace("key_env: BATCH_KEY", "key: key-batch"),
                          shedding=Shedding(queue_depth=4, kv_cache_usage=0.9, stale_after=5.0, retry_after=2))
    clock.now = time.monotonic() + 3600
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        answer = await http.post("/v1/completions", json=body(), headers=bearer("key-batch"))
    assert answer.status_code == 200, answer.text


async def test_saturation_sheds_sheddable_requests_with_a_503_never_critical_ones(tokenizer):
    backend = SaturatedBackend(tokenizer)
    app, clock = app_with(tokenizer, backend, document=DOCUMENT.replace("key_env: BATCH_KEY", "key: key-batch"),
                          shedding=Shedding(queue_depth=4, kv_cache_usage=0.9, stale_after=5.0, retry_after=2))
    monitor = app.state.ctx.monitor
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def answer(key: str) -> httpx.Response:
            await monitor.refresh()
            return await http.post("/v1/completions", json=body(), headers=bearer(key))

        assert (await answer("key-batch")).status_code == 200
        backend.waiting = 4
        shed = await answer("key-batch")
        assert shed.status_code == 503 and shed.headers["Retry-After"] == "2"
        assert shed.json()["error"]["code"] == "fleet_saturated" and "sheddable" in shed.json()["error"]["message"]
        assert (await answer("key-a")).status_code == 200 and (await answer("key-b")).status_code == 200
        backend.waiting, backend.used = 0, 60
        assert (await answer("key-batch")).status_code == 503  # KV use
        backend.used = 10
        assert (await answer("key-batch")).status_code == 200
        backend.stalled = True  # no status answers any more: the last one ages
        await monitor.refresh()
        monitor.updated -= 6  # as if it were 6 s ago, older than stale_after
        await_stale = await http.post("/v1/completions", json=body(), headers=bearer("key-batch"))
        assert await_stale.status_code == 503 and "older than" in await_stale.json()["error"]["message"]
        metrics = (await http.get("/metrics")).text
    assert ('megatron_serve_tenant_requests_refused_total{priority_class="sheddable",reason="saturated",'
            'tenant="batch"} 3.0') in metrics
