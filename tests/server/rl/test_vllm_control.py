"""vLLM's control routes (``vllm/entrypoints/serve/dev/{rlhf,sleep,cache}/api_router.py``) over real HTTP, against a
stand-in fleet that runs the lifecycle table: paths, query values, answers and errors as vLLM has them, and the
verbs each route runs."""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve.http_options import HTTPOptions
from megatron_serve.wire.lifecycle import FleetState

from ...helpers import until
from .control_app import (ADMIN, API, chunks, controlled, error_of, pause_aborts_a_stream, start_stream,
                          tokens_and_reason)

pytestmark = pytest.mark.timeout(60)


async def test_pause_runs_pause_in_each_of_vllms_modes_and_resume_unpauses(tokenizer):
    async with controlled(tokenizer) as s:
        for query, mode in (("", "abort"), ("?mode=keep", "keep"), ("?mode=wait&clear_cache=false", "wait"),
                            ("?wait_for_inflight_requests=true", "wait")):
            answer = await s.http.post(f"/pause{query}", headers=ADMIN)
            assert answer.status_code == 200 and answer.json() == {"status": "paused"}
            assert s.fleet.verbs[-1] == ("pause", {"mode": mode})
            assert (await s.http.get("/is_paused", headers=API)).json() == {"is_paused": True}
            answer = await s.http.post("/resume", headers=ADMIN)
            assert answer.status_code == 200 and answer.json() == {"status": "resumed"}
            assert s.fleet.verbs[-1] == ("unpause", {})
            assert (await s.http.get("/is_paused", headers=API)).json() == {"is_paused": False}


async def test_a_bad_or_unknown_query_value_is_a_400_naming_it(tokenizer):
    async with controlled(tokenizer) as s:
        for method, path, param in (("POST", "/pause?mode=Abort", "mode"), ("POST", "/pause?clear_cache=maybe",
                                                                            "clear_cache"),
                                    ("POST", "/pause?mode=keep&mode=wait", "mode"), ("POST", "/pause?force=1", "force"),
                                    ("POST", "/sleep?level=3", "level"), ("POST", "/sleep?mode=retract", "mode"),
                                    ("POST", "/wake_up?tags=gpu", "tags"), ("GET", "/get_world_size?include_dp=2",
                                                                            "include_dp"),
                                    ("POST", "/reset_prefix_cache?reset_external=x", "reset_external"),
                                    ("GET", "/server_info?config_format=yaml", "config_format")):
            headers = API if method == "GET" else ADMIN
            error = error_of(await s.http.request(method, path, headers=headers), 400)
            assert error["param"] == param and param in error["message"], (path, error)
        assert s.fleet.verbs == []  # nothing ran


async def test_pause_keep_holds_streams_in_flight_and_resume_finishes_every_one(tokenizer):
    async with controlled(tokenizer, tick=0.02) as s:
        opened = [await start_stream(s.http, 40) for _ in range(3)]
        reads = [asyncio.create_task(chunks(response)) for _, response in opened]
        await until(lambda: all(len(r.collector.tokens) >= 2 for r in s.fleet.requests.values())
                    and len(s.fleet.requests) == 3, 20, "three streams' first tokens")
        assert (await s.http.post("/pause?mode=keep", headers=ADMIN)).json() == {"status": "paused"}
        held = {r.request_id: len(r.collector.tokens) for r in s.fleet.requests.values()}
        await asyncio.sleep(0.2)  # ten ticks: a paused fleet makes no token
        assert {r.request_id: len(r.collector.tokens) for r in s.fleet.requests.values()} == held
        assert not any(read.done() for read in reads)
        assert (await s.http.post("/resume", headers=ADMIN)).json() == {"status": "resumed"}
        for read, (stack, _) in zip(reads, opened):
            assert tokens_and_reason(await asyncio.wait_for(read, 20)) == (40, "length")
            await stack.aclose()


async def test_pause_abort_ends_streams_with_finish_reason_abort_and_their_tokens(tokenizer):
    async with controlled(tokenizer, tick=0.02) as s:
        await pause_aborts_a_stream(s, "/pause?mode=abort", after=3)


async def test_abort_requests_ends_the_named_ones_and_the_fleet_runs_on(tokenizer):
    async with controlled(tokenizer, tick=0.02) as s:
        cut_stack, cut = await start_stream(s.http, 200, request_id="trl-cut")
        kept_stack, kept = await start_stream(s.http, 30, request_id="trl-kept")
        cut_read, kept_read = asyncio.create_task(chunks(cut)), asyncio.create_task(chunks(kept))
        await until(lambda: len(s.fleet.requests) == 2, 20, "both requests at the fleet")
        answer = await s.http.post("/abort_requests", json={"request_ids": ["trl-cut", "never-seen"]}, headers=ADMIN)
        assert answer.status_code == 200 and answer.json() == {"status": "aborted", "aborted": 1}
        found = await asyncio.wait_for(cut_read, 20)
        assert found[0]["id"] == "cmpl-trl-cut" and tokens_and_reason(found)[1] == "abort"
        assert tokens_and_reason(await asyncio.wait_for(kept_read, 20)) == (30, "length")
        assert s.fleet.verbs == []  # no pause
        await cut_stack.aclose()
        await kept_stack.aclose()

        stacks = [await start_stream(s.http, 200) for _ in range(2)]  # by the answer's id, then all of them
        reads = [asyncio.create_task(chunks(response)) for _, response in stacks]
        await until(lambda: len(s.fleet.requests) == 2, 20, "both requests at the fleet")
        assert (await s.http.post("/abort_requests", json={}, headers=ADMIN)).json()["aborted"] == 2
        for read, (stack, _) in zip(reads, stacks):
            assert tokens_and_reason(await asyncio.wait_for(read, 20))[1] == "abort"
            await stack.aclose()


async def test_abort_requests_refuses_a_body_vllm_would_not_take(tokenizer):
    async with controlled(tokenizer) as s:
        for body, param in (({"request_ids": "cmpl-1"}, "request_ids"), ({"ids": ["cmpl-1"]}, "ids")):
            error = error_of(await s.http.post("/abort_requests", json=body, headers=ADMIN), 400)
            assert error["param"] == param, error


async def test_sleep_pauses_then_suspends_and_wake_up_resumes_and_serves(tokenizer):
    async with controlled(tokenizer) as s:
        answer = await s.http.post("/sleep?level=1&mode=keep", headers=ADMIN)
        assert answer.status_code == 200 and answer.content == b""
        assert s.fleet.verbs == [("pause", {"mode": "keep"}), ("suspend", {"level": 2})]
        assert (await s.http.get("/is_sleeping", headers=API)).json() == {"is_sleeping": True}
        error = error_of(await s.http.post("/resume", headers=ADMIN), 409)  # asleep: /wake_up, not /resume
        assert "/wake_up" in error["message"]
        answer = await s.http.post("/wake_up?tags=weights", headers=ADMIN)
        assert answer.status_code == 200 and answer.content == b""
        assert s.fleet.verbs[-2:] == [("resume", {}), ("unpause", {})]
        assert (await s.http.get("/is_sleeping", headers=API)).json() == {"is_sleeping": False}
        completion = await s.http.post("/v1/completions", headers=API,
                                       json={"model": "tiny-llama", "prompt": [3, 4], "max_tokens": 3})
        assert completion.json()["usage"]["completion_tokens"] == 3  # serving again

        s.fleet.verbs.clear()
        assert (await s.http.post("/sleep", headers=ADMIN)).status_code == 200  # vLLM's defaults: level 1, abort
        assert s.fleet.verbs == [("pause", {"mode": "abort"}), ("suspend", {"level": 2})]
        await s.http.post("/wake_up?tags=weights&tags=kv_cache", headers=ADMIN)
        s.fleet.verbs.clear()
        assert (await s.http.post("/sleep?level=0", headers=ADMIN)).status_code == 200  # level 0: a pause
        assert s.fleet.verbs == [("pause", {"mode": "abort"})]
        assert (await s.http.get("/is_sleeping", headers=API)).json() == {"is_sleeping": True}


async def test_a_verb_the_lifecycle_refuses_is_a_409_naming_the_state(tokenizer):
    async with controlled(tokenizer) as s:
        s.fleet.state = FleetState.STOPPED
        error = error_of(await s.http.post("/pause", headers=ADMIN), 409)
        assert error["code"] == "illegal_transition" and "STOPPED" in error["message"]
        assert error["message"].startswith("/pause refused")


async def test_reset_prefix_cache_runs_the_verb_and_is_a_409_while_requests_hold_blocks(tokenizer):
    """vLLM's rule (``Scheduler.reset_prefix_cache``): refused while running requests hold KV, unless
    ``reset_running_requests`` recomputes them; its route answers the refusal 409."""
    async with controlled(tokenizer) as s:
        for query, running in (("", False), ("?reset_running_requests=true&reset_external=true", True)):
            answer = await s.http.post(f"/reset_prefix_cache{query}", headers=ADMIN)
            assert answer.status_code == 200 and answer.json() == {"success": True}
            assert s.fleet.verbs[-1] == ("reset_prefix_cache", {"reset_running_requests": running})
        stack, _ = await start_stream(s.http, 200)
        async with stack:
            await until(lambda: len(s.fleet.requests) == 1, 20, "the request at the fleet")
            error = error_of(await s.http.post("/reset_prefix_cache", headers=ADMIN), 409)
            assert error["code"] == "prefix_cache_in_use" and error["param"] == "reset_running_requests"
            answer = await s.http.post("/reset_prefix_cache", json={"reset_running_requests": True}, headers=ADMIN)
            assert answer.status_code == 200 and answer.json() == {"success": True}
            assert s.fleet.verbs[-1] == ("reset_prefix_cache", {"reset_running_requests": True})
        s.fleet.state = FleetState.STOPPED
        assert error_of(await s.http.post("/reset_prefix_cache", headers=ADMIN), 409)["code"] == "illegal_transition"


async def test_get_world_size_counts_tensor_ranks_times_replicas(tokenizer):
    async with controlled(tokenizer, tensor_parallel_size=2, engines=3) as s:
        assert (await s.http.get("/get_world_size", headers=API)).json() == {"world_size": 6}
        assert (await s.http.get("/get_world_size?include_dp=false", headers=API)).json() == {"world_size": 2}


async def test_server_info_has_the_vllm_config_fields_the_frameworks_read(tokenizer):
    async with controlled(tokenizer, tensor_parallel_size=2, engines=2) as s:
        info = (await s.http.get("/server_info?config_format=json", headers=API)).json()
        config = info["vllm_config"]
        assert config["model_config"]["dtype"] == "float32" and config["model_config"]["max_model_len"] == 256
        assert config["parallel_config"]["tensor_parallel_size"] == 2
        assert config["parallel_config"]["data_parallel_size"] == 2
        assert config["parallel_config"]["world_size"] == 2 and config["parallel_config"]["world_size_across_dp"] == 4
        assert config["lora_config"] is None and config["weight_transfer_config"] is None
        assert info["vllm_env"] == {} and info["system_env"] == {}
        text = (await s.http.get("/server_info", headers=API)).json()["vllm_config"]
        assert isinstance(text, str) and "tensor_parallel_size=2" in text
        models = (await s.http.get("/v1/models", headers=API)).json()["data"]
        assert models[0]["max_model_len"] == 256
    async with controlled(tokenizer, HTTPOptions(weight_transfer_backend="gloo")) as s:  # --weight-transfer-config
        config = (await s.http.get("/server_info?config_format=json", headers=API)).json()["vllm_config"]
        assert config["weight_transfer_config"] == {"backend": "gloo"}


async def test_skyrls_remote_inference_client_calls_replayed(tokenizer):
    """The control calls of SkyRL's ``skyrl_train/inference_servers/remote_inference_client.py``, as it makes them:
    ``/pause`` with ``mode`` and ``clear_cache`` in the query, ``/sleep`` with ``level`` and ``tags``, ``/wake_up``
    with ``tags``, ``/reset_prefix_cache`` with a JSON body, ``/get_world_size`` as a GET with an empty JSON body."""
    async with controlled(tokenizer, tensor_parallel_size=2) as s:
        assert (await s.http.post("/pause", params={"mode": "keep", "clear_cache": "false"}, headers=ADMIN)).json() \
            == {"status": "paused"}
        assert (await s.http.post("/resume", headers=ADMIN)).json() == {"status": "resumed"}
        answer = await s.http.post("/sleep", params={"level": "2", "tags": ["weights", "kv_cache"]}, headers=ADMIN)
        assert answer.status_code == 200 and not answer.headers.get("content-length", "0").strip("0")
        answer = await s.http.post("/wake_up", params={"tags": ["weights"]}, headers=ADMIN)
        assert answer.status_code == 200
        answer = await s.http.post("/reset_prefix_cache", json={"reset_running_requests": False}, headers=ADMIN)
        assert answer.json() == {"success": True}
        error = error_of(await s.http.post("/reset_prefix_cache", json={"reset_all": True}, headers=ADMIN), 400)
        assert error["param"] == "reset_all"
        answer = await s.http.request("GET", "/get_world_size", json={}, headers=API)
        assert answer.json() == {"world_size": 2}
        assert [verb for verb, _ in s.fleet.verbs] == ["pause", "unpause", "pause", "suspend", "resume", "unpause",
                                                       "reset_prefix_cache"]


async def test_trls_async_grpo_client_calls_replayed(tokenizer):
    """TRL's ``trl/experimental/async_grpo/vllm_client.py``: ``GET /v1/models`` for ``max_model_len``,
    ``GET /get_world_size``, ``POST /pause`` with ``params={"mode": "keep"}``, ``POST /resume``."""
    async with controlled(tokenizer) as s:
        assert (await s.http.get("/v1/models", headers=API)).json()["data"][0]["max_model_len"] == 256
        assert (await s.http.get("/get_world_size", headers=API)).json() == {"world_size": 1}
        assert (await s.http.post("/pause", params={"mode": "keep"}, headers=ADMIN)).status_code == 200
        assert (await s.http.post("/resume", headers=ADMIN)).status_code == 200
        assert s.fleet.verbs == [("pause", {"mode": "keep"}), ("unpause", {})]


async def test_acting_routes_need_the_admin_key_and_reading_ones_the_api_key(tokenizer):
    async with controlled(tokenizer) as s:
        for path in ("/pause", "/resume", "/sleep", "/wake_up", "/abort_requests", "/reset_prefix_cache"):
            assert (await s.http.post(path)).status_code == 401
            assert (await s.http.post(path, headers=API)).status_code == 403
        for path in ("/is_paused", "/is_sleeping", "/get_world_size", "/server_info"):
            assert (await s.http.get(path)).status_code == 401
            assert (await s.http.get(path, headers=API)).status_code == 200
        assert s.fleet.verbs == []

