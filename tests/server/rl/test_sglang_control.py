"""SGLang's native control API (``python/sglang/srt/entrypoints/http_server.py``) over real HTTP, against a stand-in
fleet that runs the lifecycle table: the bodies slime, miles and AReaL send, SGLang's answers, the verbs each runs.
slime's own calls are replayed as ``slime/backends/sglang_utils/external.py`` (server info) and
``server_control.py`` (``/abort_request {"abort_all": true}``, ``/health_generate``) make them."""

from __future__ import annotations

import asyncio
import time

import pytest

from ...helpers import until
from .control_app import (ADMIN, API, chunks, controlled, error_of, pause_aborts_a_stream, start_stream,
                          tokens_and_reason)

pytestmark = pytest.mark.timeout(60)


async def test_pause_generation_maps_sglangs_modes_and_continue_generation_unpauses(tokenizer):
    async with controlled(tokenizer) as s:
        for body, mode in ((None, "abort"), ({}, "abort"), ({"mode": "abort"}, "abort"),
                           ({"mode": "in_place"}, "keep"), ({"mode": "retract"}, "keep")):
            answer = await s.http.post("/pause_generation", json=body, headers=ADMIN)
            assert answer.json() == {"message": "Generation paused successfully.", "status": "ok"}
            assert s.fleet.verbs[-1] == ("pause", {"mode": mode})
            answer = await s.http.post("/continue_generation", json={}, headers=ADMIN)
            assert answer.json() == {"message": "Generation continued successfully.", "status": "ok"}
            assert s.fleet.verbs[-1] == ("unpause", {})


async def test_areals_weight_update_bracket_replayed(tokenizer):
    """AReaL's ``areal/engine/sglang_remote.py`` (``update_weights``): ``POST /pause_generation`` with no body, the
    update, then ``/continue_generation``: a request in flight ends with ``finish_reason`` ``abort`` and its tokens
    (AReaL resubmits the rest), and the fleet serves again after."""
    async with controlled(tokenizer, tick=0.02) as s:
        await pause_aborts_a_stream(s, "/pause_generation", after=2)
        assert (await s.http.post("/continue_generation", headers=ADMIN)).status_code == 200
        assert s.fleet.verbs == [("pause", {"mode": "abort"}), ("unpause", {})]
        completion = await s.http.post("/v1/completions", headers=API,
                                       json={"model": "tiny-llama", "prompt": [3, 4], "max_tokens": 3})
        assert completion.json()["choices"][0]["finish_reason"] == "length"


async def test_a_bad_body_is_a_400_naming_the_field(tokenizer):
    async with controlled(tokenizer) as s:
        for path, body, param in (("/pause_generation", {"mode": "pause"}, "mode"),
                                  ("/pause_generation", {"mode": "abort", "now": True}, "now"),
                                  ("/continue_generation", {"torch": 1}, "torch"),
                                  ("/abort_request", {"rid": 7}, "rid"),
                                  ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
                                  ("/resume_memory_occupation", {"tags": "weights"}, "tags")):
            error = error_of(await s.http.post(path, json=body, headers=ADMIN), 400)
            assert error["param"] == param, (path, body, error)
        assert s.fleet.verbs == []


async def test_abort_request_by_rid_or_all_ends_with_abort_and_the_tokens_so_far(tokenizer):
    async with controlled(tokenizer, tick=0.02) as s:
        named_stack, named = await start_stream(s.http, 200, request_id="rollout-7")
        other_stack, other = await start_stream(s.http, 200)
        named_read, other_read = asyncio.create_task(chunks(named)), asyncio.create_task(chunks(other))
        await until(lambda: len(s.fleet.requests) == 2, 20, "both requests at the fleet")
        answer = await s.http.post("/abort_request", json={"rid": "rollout-7"}, headers=ADMIN)
        assert answer.status_code == 200 and answer.content == b""
        assert tokens_and_reason(await asyncio.wait_for(named_read, 20))[1] == "abort"
        assert not other_read.done()
        assert (await s.http.post("/abort_request", json={}, headers=ADMIN)).status_code == 200  # nothing named
        assert not other_read.done()
        answer = await s.http.post("/abort_request", json={"abort_all": True}, headers=ADMIN)  # slime's call
        assert answer.status_code == 200
        assert tokens_and_reason(await asyncio.wait_for(other_read, 20))[1] == "abort"
        await named_stack.aclose()
        await other_stack.aclose()
        assert s.fleet.verbs == []


async def test_abort_request_finds_a_generate_request_by_its_rid(tokenizer):
    async with controlled(tokenizer, tick=0.02) as s:
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 200}, "rid": "areal-7"}
        answer = asyncio.create_task(s.http.post("/generate", json=body, headers=API))
        await until(lambda: any(len(r.collector.tokens) >= 2 for r in s.fleet.requests.values()), 20,
                    "a stream's first tokens")
        assert (await s.http.post("/abort_request", json={"rid": "areal-7"}, headers=ADMIN)).status_code == 200
        meta = (await asyncio.wait_for(answer, 20)).json()["meta_info"]
        assert meta["id"] == "areal-7" and meta["finish_reason"]["type"] == "abort"
        assert 2 <= meta["completion_tokens"] < 200


async def test_flush_cache_answers_sglangs_text_on_get_and_post(tokenizer):
    """RESET_PREFIX_CACHE; SGLang's 400 ``Flush cache failed.`` while a request runs (it flushes an idle scheduler)."""
    async with controlled(tokenizer) as s:
        for method in ("GET", "POST"):
            answer = await s.http.request(method, "/flush_cache", headers=ADMIN)
            assert answer.status_code == 200 and answer.text.startswith("Cache flushed.")
        assert s.fleet.verbs == [("reset_prefix_cache", {"reset_running_requests": False})] * 2
        stack, _ = await start_stream(s.http, 200)
        async with stack:
            await until(lambda: len(s.fleet.requests) == 1, 20, "the request at the fleet")
            answer = await s.http.post("/flush_cache", headers=ADMIN)
            assert answer.status_code == 400 and answer.text == "Flush cache failed.\n"


async def test_memory_occupation_suspends_and_resumes_as_slime_calls_it(tokenizer):
    async with controlled(tokenizer) as s:
        answer = await s.http.post("/release_memory_occupation", json={}, headers=ADMIN)  # every tag
        assert answer.status_code == 200 and answer.json() is None
        assert s.fleet.verbs == [("suspend", {"level": 2})]
        await s.http.post("/resume_memory_occupation", json={"tags": ["weights"]}, headers=ADMIN)
        assert s.fleet.verbs[-1] == ("resume", {})  # memory back, still paused: new weights go in now
        assert (await s.http.get("/is_paused", headers=API)).json() == {"is_paused": True}
        await s.http.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}, headers=ADMIN)
        assert s.fleet.verbs[-2:] == [("resume", {}), ("unpause", {})]
        assert (await s.http.get("/is_paused", headers=API)).json() == {"is_paused": False}

        s.fleet.verbs.clear()
        await s.http.request("GET", "/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=ADMIN)
        assert s.fleet.verbs == [("suspend", {"level": 1})]
        await s.http.post("/resume_memory_occupation", headers=ADMIN)  # no body: every tag
        assert s.fleet.verbs[-2:] == [("resume", {}), ("unpause", {})]


async def test_health_generate_generates_a_token_and_fails_while_the_fleet_does_not_step(tokenizer):
    async with controlled(tokenizer) as s:
        assert (await s.http.get("/health_generate")).status_code == 200  # no key: a probe
        await s.http.post("/pause", headers=ADMIN)
        answer = await s.http.get("/health_generate")
        assert answer.status_code == 503


async def test_health_generate_costs_one_generation_however_many_probes_ask(tokenizer, monkeypatch):
    """Issue 86: each unauthenticated /health_generate ran a generation of its own (1,226 in 40 s from 200
    connections). Probes that come while one runs share it, and its token answers them again for a second."""
    from megatron_serve.server.rl import health_generation

    async with controlled(tokenizer, tick=0.05) as s:
        started: list[list[int]] = []
        real = s.fleet._start
        monkeypatch.setattr(s.fleet, "_start", lambda prompt, *rest: (started.append(prompt), real(prompt, *rest))[1])
        began = time.monotonic()
        answers = await asyncio.gather(*(s.http.get("/health_generate") for _ in range(200)))
        for _ in range(20):
            answers.append(await s.http.get("/health_generate"))
        took = time.monotonic() - began
        assert [a.status_code for a in answers] == [200] * 220
        # one generation per FRESH_FOR at most (one in all on a quiet host), however many probes came meanwhile
        assert set(map(tuple, started)) == {(0,)} and len(started) <= 1 + took / health_generation.FRESH_FOR, took
        before = len(started)
        await asyncio.sleep(health_generation.FRESH_FOR + 0.1)  # the last token's answer expires
        assert (await s.http.get("/health_generate")).status_code == 200
        assert len(started) == before + 1  # past the second: a new generation


async def test_server_info_has_sglangs_fields_on_both_paths(tokenizer):
    async with controlled(tokenizer, tensor_parallel_size=2, engines=3) as s:
        for path in ("/server_info", "/get_server_info"):  # slime's get_server_info tries them in this order
            info = (await s.http.get(path, headers=API)).json()
            assert (info["tp_size"], info["pp_size"], info["dp_size"], info["ep_size"]) == (2, 1, 3, 1), path
            assert info["disaggregation_mode"] == "null" and info["model_path"] == "tiny-llama"
            assert info["weight_version"] == "3"
        assert (await s.http.get("/get_server_info")).status_code == 401  # the API key's, as /v1/models


async def test_acting_routes_need_the_admin_key(tokenizer):
    async with controlled(tokenizer) as s:
        for path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
                     "/release_memory_occupation", "/resume_memory_occupation"):
            assert (await s.http.post(path, json={})).status_code == 401
            assert (await s.http.post(path, json={}, headers=API)).status_code == 403
        assert s.fleet.verbs == []

