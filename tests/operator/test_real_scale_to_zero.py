"""Scale to zero and the first request after it, on the real control plane with the operator: ``kubectl scale`` of
the resource to 0 parks the fleet, the server holds a first request (a second is refused: the queue is bounded), the
desired-replicas hint asks for one group, the resource is scaled back to what the hint asks (as KEDA would), and the
held request is answered as an uninterrupted run answers it; the wake time is printed.

Real: kube-apiserver, the StatefulSet controller and the scheduler, the operator as a process with the chart's RBAC
(it renders ``spec.server.scaleFromZero`` into the server's flags and the scale subresource into engine groups);
the coordinator, the server and the engines as processes (the tiny test model on the CPU); the requests through the
official ``openai`` client and plain HTTP; ``/metrics`` and ``/ready`` scraped over HTTP. The server runs with the
arguments the operator rendered into its pod (only its addresses changed to this machine's). Simulated: the kubelet,
and KEDA. The engine pod goes to a GPU node of the test's own that kwok does not play (:mod:`.real_node` keeps it
Ready with a Lease heartbeat), where :class:`~tests.operator.real_kubelet.Kubelet` plays the kubelet: it marks the
pod Running, starts its engine, marks it Ready only once the engine registered and serves, sends the engine SIGTERM
when the pod goes and deletes the pod once the engine exited. So a fleet is parked (the resource says 0 engines
Ready, no engine pod left) only once its engine drained, and the woken group's pod is Ready no sooner than its engine
serves (under kwok it was Ready the moment it ran, and gone at once on the scale to zero). The server pod runs on the
cluster's kwok nodes: its Ready condition is what :meth:`Serving.probe` writes from the server's ``/ready`` before
each check of its Service's endpoint, so kwok's Ready is never the one read. No KEDA runs here: the test reads the
hint and scales the resource as KEDA's ScaledObject would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megatron_operator import names
from tests.helpers import Children, free_port, http_get, http_post

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_kubelet import Kubelet, set_ready
from .real_tools import MI, until

pytestmark = [pytest.mark.slow, pytest.mark.scenario, pytest.mark.timeout(600)]

NAME = "tiny"
HOLD = 240  # spec.server.scaleFromZero.timeoutSeconds: covers an engine's cold start on a loaded 2-core host
API_KEY = "test-key"  # what Fleet.prerequisites puts in the resource's API-key Secret
PROMPT = "The capital of France is"
TOKENS = 8


@dataclass
class Streamed:
    """A streamed answer: when it was sent, and each piece of text with when it came."""

    sent: float
    pieces: list[tuple[float, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.pieces)

    def line(self, expected: str) -> str:
        """Its counts as the day-2 scenarios print them (one request): failed, truncated, repeated or different
        from an uninterrupted run's text, and the longest gap between two of its pieces (the wait for the first is
        the wake)."""
        text = self.text
        truncated = text != expected and expected.startswith(text)
        times = [t for t, _ in self.pieces]
        gap = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        return (f"the held request, streamed: 1 sent, 0 failed, {int(truncated)} truncated, "
                f"{int(text != expected and not truncated)} repeated or different from an uninterrupted run; first "
                f"piece {times[0] - self.sent:.1f}s after it was sent, longest gap after it {gap:.1f}s")


class Serving:
    """The resource's coordinator and server as processes, run with the arguments the operator rendered, and the
    kubelet stand-in for its engine pods."""

    def __init__(self, fleet: Fleet, children: Children, model: str):
        self.fleet, self.children = fleet, children
        port = free_port()
        fleet.operator(MEGATRON_OPERATOR_COORDINATOR_ADDRESS=f"tcp://127.0.0.1:{port}")
        env = {"MEGATRON_SERVE_TOKEN": fleet.coordinator_token(NAME), "MEGATRON_KERNELS": "reference"}
        self.processes = [children.coordinator(model, port, env=env)]
        self.args = rendered_server_args(fleet)
        http, probe = free_port(), free_port()
        here = {"--coordinator": f"tcp://127.0.0.1:{port}", "--host": "127.0.0.1", "--port": str(http),
                "--health-port": str(probe)}
        self.processes.append(children.spawn(local(self.args, here), "server",
                                             env={**env, "MEGATRON_SERVE_API_KEY": API_KEY}))
        self.url, self.probes = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{probe}"
        self.kubelet = Kubelet(fleet, children, model, port, env, name=NAME).start()
        self.model = ""  # the served model's name, once the server answers

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        """:func:`until`, failing at once if the kubelet stand-in, the coordinator or the server failed; naming what
        it waited for."""
        def checked() -> Any:
            self.kubelet.check()
            for process in self.processes:
                if process.poll() is not None:
                    raise AssertionError(f"{self.children.log_of(process)[-3000:]}\nexited with {process.returncode}")
            return predicate()

        try:
            return until(checked, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.kubelet.describe()}") from None

    def up(self) -> bool:
        """One engine group serves and the server answers ``/ready`` with 200: the server starts beside the engine and
        may bind its port after the engine registered (a forked engine serves within a second)."""
        return self.kubelet.serving(1) and self.ready()[0] == 200

    def ready(self) -> tuple[int, dict[str, Any]]:
        """``/ready`` on the probe port: what the server pod's readiness probe reads."""
        try:
            answer = http_get(f"{self.probes}/ready", timeout=5)
        except httpx.TransportError as exc:
            return 0, {"error": str(exc)}
        return answer.status_code, answer.json()

    def probe(self) -> int:
        """The server container's readiness probe, once, as the kubelet runs it: ``/ready`` on the probe port written
        to the coordinator pod's Ready condition; the real EndpointSlice controller then lists the pod as a ready
        endpoint of the resource's Service, or not. Returns the probe's status code."""
        status = self.ready()[0]
        selector = ",".join(f"{k}={v}" for k, v in names.selector_labels(NAME, "coordinator").items())
        (pod,) = self.fleet.kubectl.get("pods", None, f"-l={selector}")
        set_ready(self.kubelet.api, pod, status == 200)
        return status

    def routable(self) -> bool | None:
        """Whether the resource's Service has a ready endpoint (None before the EndpointSlice lists the pod)."""
        slices = self.fleet.kubectl.get("endpointslices", None,
                                        f"-l=kubernetes.io/service-name={names.server_service_name(NAME)}")
        endpoints = [e for s in slices for e in s.get("endpoints") or []]
        return any(e["conditions"].get("ready") for e in endpoints) if endpoints else None

    def series(self) -> dict[str, float]:
        """``/metrics``' samples by name, summed over their labels (one model, one server here)."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(http_get(f"{self.url}/metrics", timeout=10).text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def client(self) -> openai.OpenAI:
        """The official client, waiting as long as the server may hold a request."""
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=HOLD + 60)
        self.model = self.model or client.models.list().data[0].id
        return client

    def ask(self) -> str:
        """A greedy completion through the official client."""
        answer = self.client().completions.create(model=self.model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        return answer.choices[0].text

    def stream(self) -> Streamed:
        """A greedy completion streamed through the official client: its text and when each piece came."""
        client = self.client()
        streamed = Streamed(time.monotonic())  # (the response, its headers too, begins once the hold ends)
        chunks = client.completions.create(model=self.model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                           stream=True)
        for chunk in chunks:
            if chunk.choices:  # (a usage-only chunk has none)
                streamed.pieces.append((time.monotonic(), chunk.choices[0].text))
        return streamed

    def post(self, timeout: float = 30) -> httpx.Response:
        """A completion as plain HTTP, its status and headers to read."""
        return http_post(f"{self.url}/v1/completions", timeout=timeout, headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": self.model, "prompt": PROMPT, "max_tokens": 2})

    def scale(self, replicas: int) -> None:
        """``kubectl scale`` of the resource: its scale subresource, as KEDA and an HPA set it."""
        self.fleet.kubectl.run("scale", f"{MI}/{NAME}", f"--replicas={replicas}")

    def parked(self) -> None:
        """Until the engine pod is gone, its engine drained and exited, and the resource says 0 engines."""
        self.wait(lambda: not self.kubelet.pods and not self.kubelet.registered
                  and all(p.poll() is not None for _, p in self.kubelet.engines.values())
                  and ((self.fleet.mi(NAME) or {}).get("status") or {}).get("engines", {}).get("ready") == 0,
                  120, "the fleet parked at zero engine groups")

    def close(self) -> None:
        self.kubelet.stop()


def rendered_server_args(fleet: Fleet) -> list[str]:
    """The server container's arguments in the coordinator Deployment the operator rendered."""
    deployment = until(lambda: fleet.kubectl.get("deployment", f"{NAME}-coordinator"), 60, "the coordinator Deployment")
    (server,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return list(server["args"])


def local(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the values of the flags in ``values`` replaced (the pod's addresses by this machine's)."""
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


@contextlib.contextmanager
def served(fleet: Fleet, model: str, tmp_path: pathlib.Path, scale_from_zero: dict[str, Any] | None
           ) -> Iterator[Serving]:
    """The resource applied (its ``spec.server.scaleFromZero`` where given) and served here (:class:`Serving`); its
    kubelet stand-in stopped and every process killed after, whatever the test did."""
    resource = fleet.tiny_resource(NAME, model)
    if scale_from_zero is not None:
        resource["spec"]["server"]["scaleFromZero"] = scale_from_zero
    resource["spec"]["engine"].update(fleet.gpu_pool(1, kubelet=True))
    fleet.prerequisites(resource)
    fleet.kubectl.apply([resource])
    children = Children(tmp_path)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(children.kill_all)
        serving = Serving(fleet, children, model)
        cleanup.callback(serving.close)  # first: the kubelet stops starting engines before they are killed
        yield serving


def test_a_fleet_scaled_to_zero_holds_the_first_request_until_it_is_scaled_back(fleet: Fleet, tiny_model: str,
                                                                                tmp_path: pathlib.Path):
    with served(fleet, tiny_model, tmp_path, {"timeoutSeconds": HOLD, "queue": 1}) as serving:
        flag = serving.args.index("--scale-from-zero-timeout")
        assert serving.args[flag:flag + 4] == ["--scale-from-zero-timeout", str(HOLD), "--scale-from-zero-queue",
                                               "1"], serving.args
        serving.wait(serving.up, 300, "one engine group serving and the server answering")
        uninterrupted = serving.ask()

        serving.scale(0)
        serving.parked()
        status, body = serving.wait(lambda: (r := serving.ready())[0] == 200 and r[1].get("engines") == 0 and r, 30,
                                    "/ready 200 with no engine (the request is taken and held)")
        assert body["held"] is True, body
        assert serving.probe() == 200  # the server pod stays Ready: its Service keeps sending it requests
        serving.wait(lambda: serving.routable() is True, 60, "the Service's endpoint ready")
        assert serving.series()["megatron_serve_engine_groups_wanted"] == 0

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(serving.stream)
            serving.wait(lambda: serving.series()["megatron_serve_requests_waiting_for_engine"] == 1, 60,
                         "the first request held")
            full = serving.post()
            assert full.status_code == 503 and full.json()["error"]["code"] == "no_engine", full.text
            assert int(full.headers["Retry-After"]) >= 1
            # the queue (1) is full: a request now would be refused, and the probe says so within its period
            serving.wait(lambda: serving.ready()[0] == 503, 15, "/ready 503 on the probe port with the queue full")

            # KEDA's part: the hint asks for groups, the resource is scaled to what it asks
            wanted = int(serving.series()["megatron_serve_engine_groups_wanted"])
            assert wanted == 1 and not held.done()
            # the first request after the fleet came up may have been held too (the server's status had not yet seen
            # the engine the kubelet stand-in found serving): count this wake alone
            before = serving.series()
            began = time.monotonic()
            serving.scale(wanted)
            streamed = held.result(timeout=HOLD + 30)
            woke = time.monotonic() - began
        print(streamed.line(uninterrupted))
        series = serving.series()
        print(f"wake from zero on the cluster: kubectl scale --replicas=1 -> the held request answered in {woke:.1f}s; "
              f"the server's megatron_serve_wake_seconds "
              f"{series['megatron_serve_wake_seconds_sum'] - before['megatron_serve_wake_seconds_sum']:.1f}s (arrival "
              "to the engine's registration)")
        assert streamed.text == uninterrupted, (streamed.text, uninterrupted)
        assert len(streamed.pieces) > 1, streamed.pieces  # streamed, piece by piece
        assert series["megatron_serve_wake_seconds_count"] - before["megatron_serve_wake_seconds_count"] == 1
        assert series["megatron_serve_engine_groups_wanted"] == 0
        serving.wait(lambda: serving.kubelet.serving(1), 60, "the group back, serving")
        assert serving.ask() == uninterrupted


def test_without_scale_from_zero_a_fleet_at_zero_leaves_its_service_and_asks_for_no_group(fleet: Fleet, tiny_model: str,
                                                                                        tmp_path: pathlib.Path):
    """The control: the same resource without ``spec.server.scaleFromZero``. Its server is rendered without the
    holding flags; at zero engine groups its readiness probe fails, so its Service has no ready endpoint and a request
    through it is refused at once (there is nothing to send it to); a request that reaches the server anyway is not
    held there but waits at the coordinator, and the hint never asks for a group: nothing scales the fleet back."""
    with served(fleet, tiny_model, tmp_path, None) as serving:
        assert not [a for a in serving.args if a.startswith("--scale-from-zero")], serving.args
        serving.wait(serving.up, 300, "one engine group serving and the server answering")
        serving.ask()
        # the server's /ready follows its own poll of the coordinator, which may not have seen the engine yet (the
        # answer above waited at the coordinator): probed until 200, as the kubelet probes every period
        serving.wait(lambda: serving.probe() == 200, 30, "the server's /ready 200 with the engine registered")
        serving.wait(lambda: serving.routable() is True, 60, "the Service's endpoint ready")

        serving.scale(0)
        serving.parked()
        status, body = serving.wait(lambda: (r := serving.ready())[0] == 503 and r[1].get("missing") == ["engines"]
                                    and r, 30, "/ready 503 naming the engines")
        assert body["held"] is False, body
        assert serving.probe() == 503
        serving.wait(lambda: serving.routable() is False, 60, "the Service's endpoint not ready")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(serving.post, HOLD)  # past the Service, straight to the server
            queued = serving.wait(lambda: (m := serving.series())["megatron_serve_queue_depth"] == 1 and m, 60,
                                  "the request queued at the coordinator")
            assert not sent.done()
            assert queued["megatron_serve_requests_waiting_for_engine"] == 0  # not held by the server
            assert queued["megatron_serve_engine_groups_wanted"] == 0  # nothing asks an autoscaler for a group
            serving.scale(1)  # by hand: no autoscaler would
            answer = sent.result(timeout=HOLD)
        print(f"control (no scaleFromZero): at zero the server's /ready {status} and its Service has no ready "
              f"endpoint; a request sent past it waited at the coordinator with the hint at 0, and was answered "
              f"{answer.status_code} only after a scale to 1 by hand")
        assert answer.status_code == 200, answer.text
