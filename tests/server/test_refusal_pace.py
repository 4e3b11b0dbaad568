"""A ``sheddable`` flood cannot take the server from other tenants (issue 86, docs/tenants.md): its requests are
refused at the door, before their bodies are parsed, and a tenant's refusals beyond a burst are answered at a pace
(:mod:`megatron_serve.server.refusal_pace`), so that a critical request is answered while a flood's refusals wait.

Over the fake backend (no model; the saturation is its status's); the pace's own schedule on a clock of the test's."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from megatron_serve.http_options import Shedding
from megatron_serve.server.refusal_pace import RefusalPace

from .conftest import serving
from .test_tenants import DOCUMENT, Clock, SaturatedBackend, app_with, bearer, body

pytestmark = pytest.mark.timeout(120)

SHEDDING = Shedding(queue_depth=4, kv_cache_usage=0.9, stale_after=60.0, retry_after=2)


def test_a_burst_is_answered_at_once_then_one_refusal_per_interval():
    clock = Clock()
    pace = RefusalPace(rate=10.0, burst=3, most=1.0, clock=clock)
    assert [pace.hold("flood") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [round(pace.hold("flood"), 3) for _ in range(3)] == [0.1, 0.2, 0.3]  # each one interval after the last
    assert pace.hold("other") == 0.0  # tenants are paced apart
    assert max(pace.hold("flood") for _ in range(100)) == pytest.approx(1.0)  # never held past `most`
    clock.now += 30.0  # quiet for a while: a full burst again
    assert [pace.hold("flood") for _ in range(3)] == [0.0, 0.0, 0.0]
    for bad in ({"rate": 0.0}, {"burst": 0}, {"most": -1.0}):
        with pytest.raises(ValueError, match="refusal pace"):
            RefusalPace(**bad)


async def _saturated(tokenizer):
    backend = SaturatedBackend(tokenizer)
    app, _ = app_with(tokenizer, backend, document=DOCUMENT.replace("key_env: BATCH_KEY", "key: key-batch"),
                      shedding=SHEDDING)
    return app, backend


async def test_a_sheddable_request_is_refused_before_its_body_is_parsed(tokenizer):
    app, backend = await _saturated(tokenizer)
    monitor = app.state.ctx.monitor
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def post(key: str) -> httpx.Response:
            await monitor.refresh()
            return await http.post("/v1/completions", content=b"{not json", headers=bearer(
                key, **{"Content-Type": "application/json"}))

        # the controls: a fleet with room parses the body (400), and so does a critical request into a saturated one
        assert (await post("key-batch")).status_code == 400
        backend.waiting = 4
        assert (await post("key-a")).status_code == 400
        shed = await post("key-batch")
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "fleet_saturated", shed.text


async def test_a_flood_s_refusals_wait_their_pace_while_a_critical_request_is_answered(tokenizer):
    app, backend = await _saturated(tokenizer)
    tenancy, monitor = app.state.ctx.tenancy, app.state.ctx.monitor
    tenancy.pace = RefusalPace(rate=1.0, burst=1, most=30.0)  # one refusal at once, then one a second
    backend.waiting = 4
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        await monitor.refresh()
        flood = [asyncio.ensure_future(http.post("/v1/completions", json=body(), headers=bearer("key-batch")))
                 for _ in range(3)]
        done, held = await asyncio.wait(flood, return_when=asyncio.FIRST_COMPLETED)
        assert [t.result().status_code for t in done] == [503]  # the burst: at once
        critical = await http.post("/v1/completions", json=body(), headers=bearer("key-a"))
        assert critical.status_code == 200
        assert len(held) == 2 and not any(t.done() for t in held)  # answered while the flood's refusals wait
        answers = await asyncio.gather(*held)
        assert all(a.status_code == 503 and a.headers["Retry-After"] == "2" for a in answers)
        metrics = (await http.get("/metrics")).text
    assert ('megatron_serve_tenant_requests_refused_total{priority_class="sheddable",reason="saturated",'
            'tenant="batch"} 3.0') in metrics
