"""Property-based check of ``/openapi.json``: schemathesis generates requests, the server must keep its promises.

The server here is ``serve_async_llm`` over a ``MegatronAsyncLLM`` in direct mode (a real tiny engine in this
process, on its own event-loop thread), with the context capped at 64 tokens so every generated
request is cheap. Checked on every case: no 5xx, status codes, content types, headers and bodies as
documented, and schema-violating requests rejected (400). Not checked: that every schema-valid
request is accepted — a valid body can still ask for more tokens than the context holds, which
is a documented 400 no schema can express.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from urllib.parse import parse_qs, urlsplit

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from megatron_serve.api.async_llm import MegatronAsyncLLM
from megatron_serve.config import InferenceConfig
from megatron_serve.server import serve_async_llm
from megatron_serve.server.rl import RL_ADMIN_PATHS

from ..helpers import http_get, poll_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MIN_CASES = 500
MODEL = "tiny-llama"  # the directory name of the session's tiny model
CASES: list[str] = []

# Every built-in check runs except positive_data_acceptance (see the module docstring).
EXCLUDED = [positive_data_acceptance]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_url(tiny_model):
    """``serve_async_llm`` on a background loop; yields the base URL."""
    port = _free_port()
    loop = asyncio.new_event_loop()
    llm = MegatronAsyncLLM(tiny_model, InferenceConfig(max_sequence_length=64, num_kv_blocks=256, max_requests=32))
    task_holder: dict = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        task_holder["task"] = loop.create_task(serve_async_llm(llm, "127.0.0.1", port))
        try:
            loop.run_until_complete(task_holder["task"])
        except asyncio.CancelledError:
            pass
        finally:
            loop.run_until_complete(llm.close())
            loop.close()

    thread = threading.Thread(target=main, name="serve", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    poll_ready(url, 120, lambda: None if thread.is_alive() else "serve_async_llm died during start-up",
               lambda: "serve() did not become ready", interval=0.1)
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(task_holder["task"].cancel)
        thread.join(60)


def documented_operations(url: str) -> tuple[set[str], set[str], set[str]]:
    """The operations the document lists (``METHOD /path``, the admin routes aside), those that take a body, and
    those that take nothing at all (no body, no parameter: no call to them can break their schema)."""
    document = http_get(f"{url}/openapi.json", timeout=30).json()
    operations = {f"{method.upper()} {path}": operation for path, methods in document["paths"].items()
                  for method, operation in methods.items()
                  if "admin" not in operation.get("tags", []) and path not in RL_ADMIN_PATHS}
    return (set(operations), {label for label, operation in operations.items() if "requestBody" in operation},
            {label for label, operation in operations.items()
             if "requestBody" not in operation and not operation.get("parameters")})


def _arrived_valid(document: dict, method: str, path: str, response) -> bool:
    """Whether a body-less call's query, as it went on the wire, keeps its operation's documented parameters: a
    negative case can serialize to a valid one (an array ``[0]`` of an integer parameter is sent as ``name=0``, a
    null is left out), and then a 200 is the right answer."""
    if response.request.body:
        return False
    documented = {item["name"]: item.get("schema", {})
                  for item in document["paths"][path][method.lower()].get("parameters", []) if item.get("in") == "query"}
    for name, values in parse_qs(urlsplit(response.request.url).query, keep_blank_values=True).items():
        schema = documented.get(name)
        if schema is None or len(values) != 1:
            return False
        value = values[0]
        if schema.get("type") == "integer" and not (re.fullmatch(r"-?[0-9]+", value)
                                                    and int(value) >= schema.get("minimum", int(value))):
            return False
        if schema.get("type") == "boolean" and value.lower() not in ("true", "false"):
            return False
        if "enum" in schema and value not in [str(choice) for choice in schema["enum"]]:
            return False
    return True


@pytest.mark.parametrize("mode, examples", [(GenerationMode.POSITIVE, 330), (GenerationMode.NEGATIVE, 220)])
def test_api_keeps_its_openapi_promises(served_url, mode, examples):
    # The admin routes are off here (no admin key: 403 before any body is read); test_admin_http.py checks them, and
    # tests/server/rl the RL frameworks' routes that need the admin key.
    schema = schemathesis.openapi.from_url(f"{served_url}/openapi.json").exclude(tag="admin").exclude(
        path=sorted(RL_ADMIN_PATHS))
    seen: dict[str, int] = {}
    statuses: dict[int, int] = {}
    document = http_get(f"{served_url}/openapi.json", timeout=30).json()

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        number = sum(seen.values())
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and number % 8:
            case.body["model"] = MODEL  # mostly the served name, or nearly every case is "unknown model"
        if case.path_parameters and "model" in case.path_parameters and number % 2:
            case.path_parameters["model"] = MODEL
        seen[case.operation.label] = seen.get(case.operation.label, 0) + 1
        response = case.call_and_validate(base_url=served_url, timeout=60, excluded_checks=EXCLUDED)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code == 200 and not (mode is GenerationMode.NEGATIVE and _arrived_valid(
                document, case.method, case.path, response)):
            accepted.add(f"{case.operation.label} {response.request.url}")

    accepted: set[str] = set()
    check()
    CASES.extend(label for label, count in seen.items() for _ in range(count))
    every, with_bodies, takes_nothing = documented_operations(served_url)
    if mode is GenerationMode.POSITIVE:
        assert set(seen) == every, seen  # every operation was exercised
    else:
        assert with_bodies <= set(seen), seen  # every request body was also made schema-violating
    if mode is GenerationMode.POSITIVE:
        # many valid requests really generated text (a fifth: the RL routes' random bodies mostly name no model)
        assert statuses.get(200, 0) >= examples // 5, statuses
    else:  # every schema-violating call is a 400; only an operation that takes nothing can be called right, or one
        # whose violation did not survive the trip (_arrived_valid)
        refused_nothing = {call for call in accepted if call.split(" http")[0] not in takes_nothing}
        assert set(statuses) <= {200, 400} and not refused_nothing, (statuses, refused_nothing)


def test_enough_cases_were_generated():
    by_operation: dict[str, int] = {}
    for label in CASES:
        by_operation[label] = by_operation.get(label, 0) + 1
    assert len(CASES) >= MIN_CASES, by_operation


def test_a_200_to_a_negative_case_passes_only_when_what_arrived_keeps_the_schema():
    """The allowance above, without a server: ``dp_rank=0`` (an array ``[0]`` sent) is valid; a second value, a
    non-integer, a value below the minimum, an unknown parameter or a body are not."""
    from types import SimpleNamespace

    document = {"paths": {"/v1/loads": {"get": {"parameters": [
        {"name": "dp_rank", "in": "query", "schema": {"type": "integer", "minimum": 0}},
        {"name": "include", "in": "query", "schema": {"type": "string", "enum": ["core", "all"]}}]}}}}

    def arrived(query: str, body: bytes | None = None) -> bool:
        response = SimpleNamespace(request=SimpleNamespace(body=body, url=f"http://host/v1/loads?{query}"))
        return _arrived_valid(document, "GET", "/v1/loads", response)

    assert arrived("dp_rank=0") and arrived("dp_rank=3&include=core") and arrived("")
    assert not arrived("dp_rank=0&dp_rank=0") and not arrived("dp_rank=a") and not arrived("dp_rank=-1")
    assert not arrived("include=gpu") and not arrived("other=1") and not arrived("", body=b"{}")
