"""TRL <= 1.10's ``trl vllm-serve`` control routes (``trl/scripts/vllm_serve.py``), trailing slashes and answers."""

from __future__ import annotations

import pytest

from .control_app import ADMIN, API, controlled

pytestmark = pytest.mark.timeout(60)


async def test_trls_control_routes_answer_as_trl_vllm_serve(tokenizer):
    async with controlled(tokenizer, tensor_parallel_size=2, engines=2) as s:
        assert (await s.http.get("/health/")).json() == {"status": "ok"}  # no key: TRL's client polls it first
        assert (await s.http.get("/get_world_size/", headers=API)).json() == {"world_size": 4}
        answer = await s.http.post("/reset_prefix_cache/", headers=ADMIN)
        assert answer.json() == {"message": "Request received, resetting prefix cache status: True"}
        assert (await s.http.post("/reset_prefix_cache/", headers=API)).status_code == 403
        assert (await s.http.get("/get_world_size/")).status_code == 401
        assert s.fleet.verbs == [("reset_prefix_cache", {"reset_running_requests": False})]
