"""The probe port (``--health-port``): ``/health`` and ``/ready`` answered while the main event loop cannot run.

Under 400 streams the main port's probes took up to 0.3 s (they wait for the loop the tokens keep busy,
and for the GIL). Here the server's loop is blocked outright (a pure-Python busy loop, which holds the
GIL as a saturated loop does) while another thread probes: the main port does not answer at all (the
negative control), the probe port answers 200, from a real coordinator's status on a connection of its
own, in a process of its own. Then the probe port's ``/ready`` follows the facts: 503 while draining,
503 once the coordinator is gone; its ``/health`` turns 503 once the server's loop stops stamping for
``--health-stall-timeout``. That a run's probe port agrees with its main port from the start is checked on the run
of tests/fleet/test_run_under_load.py (a run of its own here cost seconds of CPU for five probes).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import socket
import threading
import time
from typing import Any, Callable

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.commands.server import add_server_options, check_server_options
from megatron_serve.server import create_app
from megatron_serve.server.probe_port import bind_probe_socket
from megatron_serve.server.probe_process import ProbePort
from megatron_serve.server.runner import bind_socket, endpoint_url, serve_app
from megatron_serve.tokenizer import Tokenizer

from tests.helpers import Children, free_port, until

pytestmark = pytest.mark.timeout(180)


def get(url: str, path: str, timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    """One GET with ``http.client`` on a new connection (as a kubelet probes): status and JSON body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


def blocking_the_loop(work: Callable[[], Any], deadline: float = 60.0) -> Any:
    """Run ``work`` on a thread while this thread (the event loop's) spins in pure Python, holding the GIL but
    for the interpreter's switches: the loop runs no callback until ``work`` is done."""
    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    end = time.monotonic() + deadline
    while not done.is_set() and time.monotonic() < end:
        pass
    assert done.is_set(), "the probing thread did not finish"
    if "error" in result:
        raise result["error"]
    return result["value"]


async def poll(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """:func:`until` with ``predicate()`` on a thread (it makes blocking HTTP calls); a connection refused (a port
    not listening yet) counts as not yet."""
    return await until(lambda: asyncio.to_thread(predicate), timeout, what, 0.1, not_yet=(ConnectionRefusedError,))


async def test_probe_port_answers_while_the_main_loop_is_blocked(tiny_llama, tmp_path):
    children = Children(tmp_path)
    coordinator_port = free_port()
    address = f"tcp://127.0.0.1:{coordinator_port}"
    children.coordinator(tiny_llama, coordinator_port)
    children.engine(tiny_llama, coordinator_port)  # ready needs an engine that can take a request
    client = InferenceClient(address, token=children.secret, tokenizer=Tokenizer.from_pretrained(tiny_llama))
    app = create_app(client, client.tokenizer, "tiny", status_interval=0.2)
    ctx = app.state.ctx
    sock = bind_socket("127.0.0.1", 0)
    probes = ProbePort(bind_socket("127.0.0.1", 0), address, children.secret,
                       lambda: ctx.drain.draining.is_set(), interval=0.2)
    stalls = ProbePort(bind_socket("127.0.0.1", 0), address, children.secret, lambda: False,
                       stall_timeout=2.0)  # the server's loop silent this long (it stamps twice a second) is hung
    stop = asyncio.Event()
    serving = asyncio.create_task(serve_app(app, sock=sock, stop=stop))
    main, probe = endpoint_url(sock), probes.url()
    try:
        await poll(lambda: get(probe, "/ready")[0] == 200, 60, "the probe port's /ready")
        await poll(lambda: get(main, "/ready")[0] == 200, 60, "the main port's /ready")
        assert (await asyncio.to_thread(get, probe, "/v1/models"))[0] == 404  # probes only, nothing of the API

        def probe_both() -> tuple[str, list[tuple[int, dict[str, Any]]]]:
            try:
                get(main, "/health", timeout=1.0)
                main_answer = "answered"
            except (TimeoutError, socket.timeout):
                main_answer = "no answer"
            return main_answer, [get(probe, path) for path in ("/health", "/ready") * 5]

        main_answer, answers = blocking_the_loop(probe_both)
        assert main_answer == "no answer"  # the control: the main loop really was blocked
        assert [status for status, _body in answers] == [200] * 10, answers
        ready = answers[1][1]
        assert ready["ready"] and ready["state"] == "RUNNING" and ready["coordinator_reachable"], ready

        ctx.drain.draining.set()  # what the first SIGTERM does
        _status, body = await poll(lambda: (lambda a: a if a[0] == 503 else None)(get(probe, "/ready")), 10,
                                   "/ready 503 while draining")
        assert (body["ready"], body["detail"]) == (False, "this server is shutting down (draining)")
        assert (await asyncio.to_thread(get, probe, "/health"))[0] == 200  # draining is not dead
        ctx.drain.draining.clear()
        await poll(lambda: get(probe, "/ready")[0] == 200, 10, "/ready 200 once the drain is called off")

        await poll(lambda: get(stalls.url(), "/health")[0] == 200, 60, "the second probe port")
        stalled = blocking_the_loop(lambda: _until_status(stalls.url(), "/health", 503, 30))  # a hung loop ...
        assert stalled["status"] == "stalled", stalled
        await poll(lambda: get(stalls.url(), "/health")[0] == 200, 10, "/health once the loop runs again")  # ... runs

        children.kill_all()  # the coordinator is gone: not ready, and says why
        _status, gone = await poll(lambda: (lambda a: a if a[0] == 503 else None)(get(probe, "/ready")), 30,
                                   "/ready 503 without a coordinator")
        assert gone["coordinator_reachable"] is False and gone["ready"] is False, gone
        assert "coordinator" in gone["detail"], gone
        assert (await asyncio.to_thread(get, probe, "/health"))[0] == 200  # the process lives: no restart for that
        await probes.aclose()
        await stalls.aclose()
        assert (probes.proc.returncode, stalls.proc.returncode) == (0, 0)  # ended by the pipe's end, not killed
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)
        await probes.aclose()
        await stalls.aclose()
        client.close()
        children.kill_all()


def _until_status(url: str, path: str, status: int, timeout: float) -> dict[str, Any]:
    """Blocking: GET ``path`` until it answers ``status``; that answer's body."""
    deadline = time.monotonic() + timeout
    while True:
        got, body = get(url, path)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"{path} never answered {status}; last {got} {body}"
        time.sleep(0.05)


def server_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_options(parser, default_host="127.0.0.1")
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--health-port", "-1"], "--health-port must be a port number"),
    (["--health-port", "65536"], "--health-port must be a port number"),
    (["--port", "8000", "--health-port", "8000"], "--health-port must differ from --port"),
    (["--health-stall-timeout", "0"], "--health-stall-timeout must be > 0"),
    (["--health-stall-timeout", "nan"], "--health-stall-timeout must be > 0"),
])
def test_bad_probe_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        check_server_options(server_args(*argv))


def test_probe_socket_default_explicit_and_off():
    main = bind_socket("127.0.0.1", 0)
    port = main.getsockname()[1]
    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    try:
        assert bind_probe_socket("127.0.0.1", 0, port) is None  # 0: no probe port
        with pytest.raises(RuntimeError, match="--health-port"):  # an explicit port that is taken fails the start
            bind_probe_socket("127.0.0.1", taken.getsockname()[1], port)
        # the default: --port + 1, or any free port when that one is taken (here: by `taken`)
        fallback = bind_probe_socket("127.0.0.1", None, taken.getsockname()[1] - 1)
        assert fallback is not None and fallback.getsockname()[1] != taken.getsockname()[1]
        fallback.close()
        check_server_options(server_args("--port", "0", "--health-port", "9001"))  # accepted
    finally:
        main.close()
        taken.close()
