"""slime's top-p replay through a real ``megatron-serve run`` (server, coordinator and engine processes): top-p token
ids without top_k (slime's default ``--rollout-top-k -1``) are counted as the engine produces them, against the
coordinator's ``--max-request-logprobs`` (``run`` gives it the server's figure). Under a budget of 2 x the vocabulary
+ 2, a 2-token request is served whatever its sets; a 64-token one at temperature 1.5 and top_p 0.99 passes the
budget with its real ids and ends with the cap named: a 400 ``over_budget`` whole, a final error event streamed. The
fleet serves the next request."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

from megatron_serve.model.config import ModelConfig

from ..conftest import served_run

pytestmark = [pytest.mark.timeout(600)]

ASKED = {"custom_params": {"return_top_p_token_ids": True}}
WIDE = {"temperature": 1.5, "top_p": 0.99, "max_new_tokens": 64, "ignore_eos": True, **ASKED}
SHORT = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 2, "ignore_eos": True, **ASKED}


def _generate(http: httpx.Client, params: dict[str, Any], stream: bool = False) -> httpx.Response:
    return http.post("/generate", json={"input_ids": [5, 6, 7, 8], "return_logprob": True, "stream": stream,
                                        "sampling_params": params})


def test_kept_ids_past_the_budget_end_the_request_and_the_fleet_serves_the_next(tiny_model, tmp_path):
    vocab = ModelConfig.from_dir(tiny_model).vocab_size
    budget = 2 * vocab + 2  # a 2-token request's ids and log probs at their most
    with served_run(tiny_model, tmp_path, "--max-request-logprobs", str(budget), env=os.environ) as url, \
            httpx.Client(base_url=url, timeout=120) as http:
        served = _generate(http, SHORT)
        assert served.status_code == 200, served.text
        assert served.json()["meta_info"]["top_p_token_offsets"]  # its kept ids came back

        whole = _generate(http, WIDE)
        assert whole.status_code == 400, whole.text
        error = whole.json()["error"]
        assert error["code"] == "over_budget", error
        assert f"budget of {budget:,} per request (--max-request-logprobs)" in error["message"], error
        assert "top-p token ids in" in error["message"] and "was ended" in error["message"]

        streamed = _generate(http, WIDE, stream=True)
        data = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]", streamed.text[-500:]
        last = json.loads(data[-2])
        assert f"budget of {budget:,} per request" in json.dumps(last), last  # the stream's final event: the error
        assert len(data) >= 3, data  # tokens were streamed before it

        again = _generate(http, SHORT)
        assert again.status_code == 200, again.text
