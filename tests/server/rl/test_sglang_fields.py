"""SGLang's request fields a text request carries and ``GET /v1/loads``, as AReaL and slime send and read them, and
SkyRL's ``/finish_session``.

AReaL's SGLang backend (``areal/engine/sglang_remote.py``) always sends ``image_data``: ``null`` at AReaL 4aef98d,
``[]`` in areal 1.0.4; slime (``slime/backends/sglang_utils/server_control.py``, slime 624b824:
``abort_server_until_idle``) aborts and then polls ``/v1/loads?include=core`` until ``num_requests_from_load`` is 0.
Against ``FakeBackend`` (shapes) and the controlled fleet (loads), no model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ...helpers import until
from .control_app import ADMIN, API, controlled, start_stream
from .tokens_app import error_of, fake_http

pytestmark = pytest.mark.timeout(120)


def num_requests_from_load(load: Any) -> int:
    """slime's reading of a load answer, as ``server_control.py`` (slime 624b824) has it."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


async def test_a_text_request_with_generate_req_inputs_neutral_fields_is_served(tokenizer):
    """AReaL's payload (``SGLangBackend.build_generation_request``): ``image_data`` null, with the other fields of
    SGLang's ``GenerateReqInput`` a text request carries at their defaults."""
    async with fake_http(tokenizer) as http:
        body = {"input_ids": [5, 6, 7], "image_data": None, "sampling_params": {"max_new_tokens": 2},
                "return_logprob": True, "stream": False, "return_hidden_states": False, "lora_path": None,
                "routed_experts_start_len": 0, "modalities": None, "conversation_id": "c-1", "no_logs": False}
        answer = await http.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["output_ids"]) == 2
        no_images = await http.post("/generate", json={**body, "image_data": [], "video_data": []})  # areal 1.0.4's
        assert no_images.status_code == 200, no_images.text
        for field, value in (("image_data", "aGk="), ("image_data", [""]), ("return_hidden_states", True),
                             ("lora_path", "/adapter"), ("input_embeds", [[0.5]])):
            refused = error_of(await http.post("/generate", json={**body, field: value}))
            assert refused["param"] == field and "not served by /generate" in refused["message"]
        empty = await http.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2,
                                                                                "custom_params": {}}})
        assert empty.status_code == 200
        processor = {"max_new_tokens": 2, "custom_params": {"scale": 2.0}}  # a custom logit processor's
        refused = error_of(await http.post("/generate", json={**body, "sampling_params": processor}))
        assert refused["param"] == "sampling_params.custom_params.scale"


async def test_v1_loads_counts_what_runs_until_an_abort_leaves_the_fleet_idle(tokenizer):
    async with controlled(tokenizer, engines=2) as s:
        idle = (await s.http.get("/v1/loads", params={"include": "core"}, headers=API)).json()
        assert [load["dp_rank"] for load in idle["loads"]] == [0, 1] and num_requests_from_load(idle) == 0
        assert set(idle) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        stack, _ = await start_stream(s.http, 200)
        try:
            await until(lambda: s.fleet.requests, 20, "the stream's request at the fleet")

            async def load() -> int:
                return num_requests_from_load((await s.http.get("/v1/loads?include=core", headers=API)).json())

            assert await load() >= 1
            assert (await s.http.post("/abort_request", json={"abort_all": True}, headers=ADMIN)).status_code == 200
            for _ in range(100):  # slime's loop: abort, then poll the load until it is 0
                if await load() == 0:
                    break
                await asyncio.sleep(0.05)
            assert await load() == 0
        finally:
            await stack.aclose()
        for query, param in (("include=memory", "include"), ("format=prometheus", "format"), ("dp_rank=5", "dp_rank"),
                             ("nope=1", "nope")):
            assert error_of(await s.http.get(f"/v1/loads?{query}", headers=API))["param"] == param
        assert (await s.http.get("/v1/loads")).status_code == 401


async def test_skyrls_finish_session_is_answered_and_refuses_a_call_without_its_session(tokenizer):
    """SkyRL's ``RemoteInferenceClient.finish_session`` (``remote_inference_client.py``, SkyRL a956457) posts
    ``/finish_session?session_id=`` when a trajectory ends; a 404 there was logged on every trajectory."""
    async with controlled(tokenizer) as s:
        done = await s.http.post("/finish_session", params={"session_id": "traj-7"}, headers=API)
        assert done.status_code == 200 and done.json() == {"status": "ok", "session_id": "traj-7"}
        assert error_of(await s.http.post("/finish_session", headers=API))["param"] == "session_id"
        assert error_of(await s.http.post("/finish_session?session_id=a&x=1", headers=API))["param"] == "x"
        assert (await s.http.post("/finish_session", params={"session_id": "traj-7"})).status_code == 401
