"""Sessions and data-parallel pins over a real ``megatron-serve run`` of three engines (server.placement).

The fleet routes ``round_robin``, so without placement consecutive requests visit every engine; ``--batch-invariant``
makes a prompt's tokens the same on any engine, which is how a moved session's turns are checked: each equals the
same prompt sent without a session. Which engine ran a request is read from the coordinator's per-engine
``completed`` counts (``/v1/admin/status``), before and after each request (one at a time).
"""

from __future__ import annotations

import os
import random
import signal
import time
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from .conftest import admin_run

pytestmark = [pytest.mark.timeout(600)]

ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GENERATE = "/inference/v1/generate"
ENGINES = 3


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory) -> Iterator[SimpleNamespace]:
    with admin_run(tiny_model, tmp_path_factory.mktemp("placement-run"), ADMIN_KEY, "--engines", str(ENGINES),
                   "--routing", "round_robin", "--batch-invariant", "--block-size", "16",
                   "--session-affinity-ttl", "300", "--health-port", "0",  # no probe port: not what is tested here
                   env=os.environ) as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            served = SimpleNamespace(http=http, model=os.path.basename(tiny_model))
            wait_engines(served, ENGINES)
            yield served


def engines(served: SimpleNamespace) -> list[dict]:
    answer = served.http.get("/v1/admin/status", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return answer.json()["engines"]


def wait_engines(served: SimpleNamespace, count: int, without: str | None = None) -> list[dict]:
    deadline = time.monotonic() + 120
    while True:
        listed = engines(served)
        if len(listed) == count and all(e["id"] != without for e in listed):
            return listed
        assert time.monotonic() < deadline, f"{count} engines (without {without}) never registered: {listed}"
        time.sleep(0.1)


def generate(served: SimpleNamespace, prompt: list[int], headers: dict[str, str] | None = None,
             **body: object) -> tuple[list[int], str]:
    """One request's generated token ids, and the id of the engine that ran it."""
    before = {e["id"]: e["completed"] for e in engines(served)}
    answer = served.http.post(GENERATE, headers=headers or {}, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}, **body})
    assert answer.status_code == 200, answer.text
    ran = [e["id"] for e in engines(served) if e["completed"] > before.get(e["id"], 0)]
    assert len(ran) == 1, ran
    return answer.json()["choices"][0]["token_ids"], ran[0]


def test_a_session_stays_on_its_engine_and_moves_with_its_texts_when_that_engine_is_killed(served):
    rng = random.Random(3)
    histories = {name: [rng.randrange(5, 500) for _ in range(40)] for name in ("a", "b")}
    homes: dict[str, set[str]] = {"a": set(), "b": set()}
    for turn in range(4):  # the two sessions alternate, with a request of no session between: round robin turns
        for name, tagged in (("a", {"headers": {"X-Session-ID": "traj-a"}}), ("b", {"session_id": "traj-b"})):
            tokens, engine = generate(served, histories[name], **tagged)
            homes[name].add(engine)
            histories[name] += tokens + [rng.randrange(5, 500) for _ in range(3)]  # the tool's answer
            generate(served, [rng.randrange(5, 500) for _ in range(8)])
    assert len(homes["a"]) == 1 and len(homes["b"]) == 1, homes  # every turn on one engine: 100%
    sessions = served.http.get("/v1/admin/status", headers=ADMIN).json()["sessions"]
    assert sessions["sessions"] == 2 and sessions["kept"] == 6 and sessions["moved"] == 0, sessions

    (home,) = homes["a"]
    pid = next(e["info"]["pid"] for e in engines(served) if e["id"] == home)
    os.kill(pid, signal.SIGKILL)  # the run's supervisor starts it again, under a new registration
    wait_engines(served, ENGINES, without=home)
    moved = set()
    for _ in range(2):
        tokens, engine = generate(served, histories["a"], headers={"X-Session-ID": "traj-a"})
        reference, _ = generate(served, histories["a"])
        assert tokens == reference  # texts intact: what any engine answers
        moved.add(engine)
        histories["a"] += tokens + [7, 8, 9]
    assert len(moved) == 1 and home not in moved, (home, moved)


def test_a_rank_pins_its_engine_and_a_bad_rank_is_a_400_naming_the_header(served):
    ordered = sorted(engines(served), key=lambda e: (e["group"], e["info"].get("data_parallel_rank", 0)))
    prompt = [11, 12, 13, 14]
    for rank in (2, 0, 2, 1):
        _, engine = generate(served, prompt, headers={"X-data-parallel-rank": str(rank)})
        assert engine == ordered[rank]["id"]
    for value, message in (("3", "rank 3 is out of range: 3 engine(s) serve (ranks 0 to 2)"),
                           ("-1", "must be a non-negative integer"), ("one", "must be a non-negative integer")):
        for path, body in ((GENERATE, {"token_ids": prompt}),
                           ("/v1/completions", {"model": served.model, "prompt": prompt, "max_tokens": 2})):
            answer = served.http.post(path, json=body, headers={"X-data-parallel-rank": value})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "X-data-parallel-rank" and message in error["message"], error
    bad = served.http.post("/v1/chat/completions", json={"model": served.model, "session_id": "",
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id", bad.text
