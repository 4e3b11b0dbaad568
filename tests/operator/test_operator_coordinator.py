"""The operator against a real coordinator and engine processes on 127.0.0.1.

kopf runs against the strict emulator; the coordinator address is pointed at 127.0.0.1 (what
``MEGATRON_OPERATOR_COORDINATOR_ADDRESS`` does in production); the token comes from the Secret
the operator created. Patching ``spec.lifecycle`` through Paused, Suspended, Running and
Shutdown drives the coordinator through the same states, with acknowledgements, and
``status.lifecycle.observed`` follows; restarting the operator or the coordinator midway
converges. The fake workload controllers stand in for the StatefulSet controller: the test
starts and stops the engine process the way the StatefulSet's replica count says.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import pathlib
import signal
from typing import Any

import pytest

from .helpers import NS, ROOT, load_yaml, posted, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def coordinator_state(address: str, token: str) -> dict[str, Any]:
    from megatron_operator.coordinator_link import ClientLink

    link = await ClientLink.open(address, token, 10.0)
    try:
        return await link.status(10.0)
    finally:
        await link.close()


async def operate_tiny_resource(cluster, tiny_model: str, monkeypatch: pytest.MonkeyPatch):
    """Apply a one-engine resource for ``tiny_model`` and run the operator with its real coordinator link,
    pointed at a free port on 127.0.0.1; returns ``(port, address, coordinator token)``."""
    from megatron_operator import handlers

    from tests.helpers import free_port

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    monkeypatch.setattr(handlers, "CONFIG", dataclasses.replace(
        handlers.CONFIG, coordinator_address_template=address, connect_timeout=3.0, command_timeout=60.0))
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource = copy.deepcopy(resource)
    resource["metadata"] = {"name": "tiny", "namespace": NS}
    resource["spec"]["model"] = {"path": tiny_model, "dtype": "float32"}
    resource["spec"]["drainTimeoutSeconds"] = 5
    await cluster.install_crd()
    cluster.start_controllers()
    await cluster.apply(resource)
    await cluster.start_operator()  # the real link: megatron_serve.InferenceClient
    token = await wait_for(lambda: cluster.token_of(NS, "tiny"), what="the coordinator Secret")
    return port, address, token


async def test_lifecycle_with_a_real_coordinator(cluster, tiny_model: str, tmp_path: pathlib.Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    from tests.helpers import Children

    port, address, token = await operate_tiny_resource(cluster, tiny_model, monkeypatch)
    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}

    def start_coordinator():
        return children.coordinator(tiny_model, port, env=env)

    def start_engine():
        return children.engine(tiny_model, port, "--group", "0", "--device", "cpu", "--dtype", "float32",
                               "--drain-timeout", "5", env=env)

    def replicas() -> int:
        return cluster.emu.find("statefulsets", NS, "tiny-engine-0")["spec"]["replicas"]

    async def expect(lifecycle: str, phase: str, state: str) -> None:
        await wait_for(lambda: (st := cluster.status(NS, "tiny")).get("phase") == phase
                       and st["lifecycle"]["observed"] == lifecycle, timeout=120, what=f"{lifecycle}/{phase}")
        assert (await coordinator_state(address, token))["state"] == state

    try:
        coordinator = start_coordinator()
        engine = start_engine()
        await wait_for(lambda: cluster.status(NS, "tiny").get("phase") == "Ready", timeout=180,
                       what="Ready with a real coordinator and engine")
        assert (await coordinator_state(address, token))["state"] == "RUNNING"
        st = cluster.status(NS, "tiny")
        assert st["engines"] == {"desired": 1, "ready": 1, "connected": 1}

        await cluster.patch_mi(NS, "tiny", {"spec": {"lifecycle": "Paused", "pauseMode": "Wait"}})
        await expect("Paused", "Paused", "PAUSED")
        assert cluster.status(NS, "tiny")["lifecycle"]["message"].startswith("PAUSE (wait) acknowledged")
        await cluster.patch_mi(NS, "tiny", {"spec": {"lifecycle": "Suspended"}})
        await expect("Suspended", "Suspended", "SUSPENDED")
        await cluster.patch_mi(NS, "tiny", {"spec": {"lifecycle": "Running"}})
        await expect("Running", "Ready", "RUNNING")
        events = await posted(cluster, NS, "Lifecycle", count=4)
        assert [m.split(" ")[0] for m in events] == ["PAUSE", "SUSPEND", "RESUME", "UNPAUSE"]

        # the operator restarts while the desired state changes: it converges when it is back
        await cluster.stop_operator()
        await cluster.patch_mi(NS, "tiny", {"spec": {"lifecycle": "Paused"}})
        await cluster.start_operator()
        await expect("Paused", "Paused", "PAUSED")

        # the coordinator restarts (it comes back RUNNING): the timer pauses it again
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(timeout=30)
        coordinator = start_coordinator()
        await wait_for(lambda: coordinator_is(address, token, "PAUSED"), timeout=120,
                       what="the restarted coordinator paused again")
        await expect("Paused", "Paused", "PAUSED")

        # Shutdown: STOP (the engine drains and exits), then the StatefulSet scales to zero
        await cluster.patch_mi(NS, "tiny", {"spec": {"lifecycle": "Shutdown"}})
        await wait_for(lambda: cluster.status(NS, "tiny").get("phase") == "Shutdown", timeout=120, what="Shutdown")
        assert replicas() == 0
        assert (await coordinator_state(address, token))["state"] == "STOPPED"
        await asyncio.to_thread(engine.wait, 60)
        assert engine.returncode == 0, children.log_of(engine)[-2000:]

        # back to Running: the StatefulSet scales up (we start its pod), UNPAUSE restarts the fleet
        await cluster.patch_mi(NS, "tiny", {"spec": {"lifecycle": "Running"}})
        await wait_for(lambda: replicas() == 1, what="the engine StatefulSet scaled up")
        engine = start_engine()
        await expect("Running", "Ready", "RUNNING")
        assert cluster.status(NS, "tiny")["engines"]["connected"] == 1

        # deletion: the finalizer STOPs the fleet (the engine drains and exits) before GC
        await cluster.must("DELETE", cluster.mi_path(NS, "tiny"))
        await wait_for(lambda: cluster.mi(NS, "tiny") is None, timeout=60, what="deleted")
        assert (await coordinator_state(address, token))["state"] == "STOPPED"
        await asyncio.to_thread(engine.wait, 60)
        assert engine.returncode == 0
    finally:
        await cluster.stop_operator()
        children.kill_all()


async def coordinator_is(address: str, token: str, state: str) -> bool:
    try:
        return (await coordinator_state(address, token))["state"] == state
    except Exception:
        return False


async def test_model_path_change_refits_a_real_fleet_in_place(cluster, tiny_model: str, tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    """Patching spec.model.path refits the running engine (no pod template change) and status.model.epoch
    increases; a checkpoint of another hidden size is refused and the pods roll instead."""
    from megatron_serve import InferenceClient, MegatronLLM, SamplingParams
    from megatron_serve.model.tiny import make_tiny_model

    from tests.helpers import Children

    second = str(make_tiny_model(tmp_path / "second", seed=1))
    wide = str(make_tiny_model(tmp_path / "wide", seed=2, hidden_size=96))
    greedy = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    with MegatronLLM(second) as llm:
        expected = llm.generate(["Hello there"], greedy)[0].generated_tokens

    port, address, token = await operate_tiny_resource(cluster, tiny_model, monkeypatch)
    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}

    def template_args() -> dict[str, list[str]]:
        return {obj["metadata"]["name"]: obj["spec"]["template"]["spec"]["containers"][0]["args"]
                for plural in ("statefulsets", "deployments") for obj in cluster.emu.objects_of(plural, NS)}

    try:
        children.coordinator(tiny_model, port, env=env)
        children.engine(tiny_model, port, "--group", "0", "--device", "cpu", "--dtype", "float32",
                        "--drain-timeout", "5", env=env)
        await wait_for(lambda: cluster.status(NS, "tiny").get("phase") == "Ready", timeout=180, what="Ready")
        before = template_args()
        generation = cluster.emu.find("statefulsets", NS, "tiny-engine-0")["metadata"]["generation"]

        await cluster.patch_mi(NS, "tiny", {"spec": {"model": {"path": second}}})
        st = await wait_for(lambda: (s := cluster.status(NS, "tiny")).get("model", {}).get("epoch") == 1 and s,
                            timeout=120, what="status.model.epoch 1")
        assert st["model"]["path"] == second and st["model"]["templatePath"] == tiny_model
        assert template_args() == before
        assert cluster.emu.find("statefulsets", NS, "tiny-engine-0")["metadata"]["generation"] == generation
        fleet = await coordinator_state(address, token)
        assert fleet["state"] == "RUNNING" and fleet["epoch"] == 1 and fleet["weights"] == second
        assert [e["epoch"] for e in fleet["engines"]] == [1]
        async with InferenceClient(address, token=token) as client:
            result = await client.add_request("Hello there", greedy)
        assert result.generated_tokens == expected and set(result.policy_epochs) == {1}
        await wait_for(lambda: cluster.status(NS, "tiny").get("phase") == "Ready", timeout=60, what="Ready again")

        await cluster.patch_mi(NS, "tiny", {"spec": {"model": {"path": wide}}})
        st = await wait_for(lambda: (s := cluster.status(NS, "tiny"))["model"]["templatePath"] == wide and s,
                            timeout=120, what="the pods roll onto the refused path")
        assert st["model"]["epoch"] == 0
        assert wide in template_args()["tiny-engine-0"]
        refused = await posted(cluster, NS, "RefitFailed")
        assert "hidden_size is 96 but the serving model has 64" in refused[-1]
        fleet = await coordinator_state(address, token)  # the old pods serve the old weights until replaced
        assert fleet["state"] == "RUNNING" and fleet["epoch"] == 1
    finally:
        await cluster.stop_operator()
        children.kill_all()


async def test_a_coordinator_container_restart_under_load_loses_no_request_of_the_pods_server(
        cluster, tiny_model: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """The coordinator pod's two containers as the operator renders them: the coordinator is killed while 20
    streams run through the server container, and comes back as the kubelet restarts it. The server says
    it is not ready meanwhile (``/health`` stays 200), every stream ends with all its tokens, and the
    resource is Ready again."""
    import httpx

    from tests.helpers import Children, free_port
    from tests.run_stack import stream

    port, address, token = await operate_tiny_resource(cluster, tiny_model, monkeypatch)
    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}
    deploy = await wait_for(lambda: cluster.emu.find("deployments", NS, "tiny-coordinator"), what="the Deployment")
    (server_container,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    http_port, probe_port = free_port(), free_port()
    args = list(server_container["args"])  # as rendered, but on this machine's free ports
    for flag, value in (("--coordinator", address), ("--host", "127.0.0.1"), ("--port", str(http_port)),
                        ("--health-port", str(probe_port))):
        args[args.index(flag) + 1] = value
    assert args[args.index("--drain-timeout") + 1] == "5"  # the resource's drainTimeoutSeconds
    url = f"http://127.0.0.1:{http_port}"
    probes = f"http://127.0.0.1:{probe_port}"  # where the rendered probes go (spec.server.probePort)
    assert server_container["readinessProbe"]["httpGet"]["port"] == server_container["livenessProbe"]["httpGet"][
        "port"] == int(server_container["args"][server_container["args"].index("--health-port") + 1])

    async def ready() -> int:
        try:
            async with httpx.AsyncClient(timeout=5, verify=False) as http:  # plain HTTP: no CA bundle to load each poll
                return (await http.get(f"{probes}/ready")).status_code
        except httpx.TransportError:
            return 0

    try:
        coordinator = children.coordinator(tiny_model, port, env=env)
        children.engine(tiny_model, port, "--group", "0", "--device", "cpu", "--dtype", "float32", env=env)
        children.spawn(args, "server", env)
        await wait_for(lambda: cluster.status(NS, "tiny").get("phase") == "Ready", timeout=180, what="Ready")
        await wait_for(lambda: ready_is(ready, 200), timeout=120, what="the server ready")
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            firsts = [asyncio.Event() for _ in range(20)]
            streams = [asyncio.create_task(stream(http, model, f"Pod {i}: the river and the stone", 48, first))
                       for i, first in enumerate(firsts)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            coordinator.send_signal(signal.SIGKILL)
            coordinator.wait(timeout=30)
            await wait_for(lambda: ready_is(ready, 503), timeout=15, what="the server not ready without a coordinator")
            assert (await http.get("/health")).status_code == 200
            assert (await http.get(f"{probes}/health")).status_code == 200
            coordinator = children.coordinator(tiny_model, port, env=env)  # what the kubelet does
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 300)
        assert all(o.completed and o.finish_reason == "length" and len(o.tokens) == 48 for o in outcomes), outcomes
        await wait_for(lambda: ready_is(ready, 200), timeout=60, what="the server ready again")
        await wait_for(lambda: cluster.status(NS, "tiny").get("phase") == "Ready", timeout=120, what="Ready again")
    finally:
        await cluster.stop_operator()
        children.kill_all()


async def ready_is(ready, status: int) -> bool:
    return await ready() == status
