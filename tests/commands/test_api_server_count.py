"""``megatron-serve run --api-server-count 2``: two HTTP processes on one port, one fleet.

Each process must serve on its own (its own coordinator client), apply the same API keys, count into
one ``/metrics`` (a scrape of either sums both), keep one budget for a tenant whatever process its
requests reach, and drain and exit with the run. Which process accepts a connection is the kernel's
choice, so the test chooses for it: a process stopped with SIGSTOP accepts nothing, and the other
one serves every new connection.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.helpers import http_get, http_post, wait_until
from tests.run_stack import child_pids, start_run
from tests.server.conftest import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "sk-test-api-server-count"
CAPPED = "sk-test-capped-tenant"
# the first key is the anonymous tenant's (no limits); the second, a tenant's of two requests a minute
KEYS = json.dumps({"tenants": {"capped": {"class": "standard", "requests_per_minute": 2}},
                   "keys": [{"key": KEY}, {"key": CAPPED, "tenant": "capped"}]})


def siblings(run_pid: int) -> list[int]:
    """The run's sibling API server processes, from /proc."""
    found = []
    for pid in child_pids(run_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megatron_serve.commands.api_sibling" in argv:
            found.append(pid)
    return found


def complete(url: str, model: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_post(f"{url}/v1/completions", headers=headers, timeout=120,
                      json={"model": model, "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})


def completed(url: str) -> float:
    return metric(http_get(f"{url}/metrics", timeout=30).text, "megatron_serve_requests_total", 'status="completed"')


def test_two_api_servers_share_the_port_the_keys_the_tenants_limits_and_the_metrics(tiny_llama, tmp_path):
    stack = start_run(tiny_llama, tmp_path / "run", "--api-server-count", "2", "--api-key", KEYS, engines=1,
                      api_key=KEY)
    try:
        (sibling,) = siblings(stack.proc.pid)
        os.kill(stack.proc.pid, signal.SIGSTOP)  # only the sibling accepts now (once it loaded its tokenizer)
        try:
            first = [complete(stack.url, stack.model) for _ in range(3)]
            refused = complete(stack.url, stack.model, key=None)
            capped = [complete(stack.url, stack.model, key=CAPPED)]  # one of the tenant's two a minute, here
        finally:
            os.kill(stack.proc.pid, signal.SIGCONT)
        assert [r.status_code for r in first] == [200, 200, 200], [r.text for r in first]
        assert refused.status_code == 401  # the sibling requires the same key
        os.kill(sibling, signal.SIGSTOP)  # now only the run's own server accepts
        try:
            # the tenant's second of the minute, then a 429: each process alone would have admitted a whole budget
            capped += [complete(stack.url, stack.model, key=CAPPED) for _ in range(2)]
            assert [r.status_code for r in capped] == [200, 200, 429], [r.text for r in capped]
            assert 1 <= int(capped[-1].headers["Retry-After"]) <= 30
            second = [complete(stack.url, stack.model) for _ in range(2)]
            assert [r.status_code for r in second] == [200, 200], [r.text for r in second]
            # The run's process answers the scrape, and counts the sibling's requests too.
            seen: list[float] = []
            try:
                wait_until(lambda: seen.append(completed(stack.url)) or seen[-1] == 7, 30,
                           "the sibling's requests in the run's /metrics")
            except TimeoutError as exc:
                raise AssertionError(f"{exc}; completed requests seen: {sorted(set(seen))}\n"
                                     f"{stack.output()[-3000:]}") from None
        finally:
            os.kill(sibling, signal.SIGCONT)
        assert completed(stack.url) == 7  # from either process
        stack.proc.send_signal(signal.SIGINT)  # drains both, then the fleet
        assert stack.proc.wait(120) == 130, stack.output()[-3000:]  # the shell's code for an interrupt
        wait_until(lambda: not os.path.exists(f"/proc/{sibling}"), 30, "the sibling to exit")
        assert "restarting it" not in stack.output()  # a sibling the signal ended is not started again
    finally:
        stack.kill()
