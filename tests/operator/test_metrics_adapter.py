"""The custom-metrics adapter (``megatron-serve metrics-adapter``) over real HTTPS: what it serves to the API server's
front proxy, and what it refuses to anyone else.

Real: the adapter's aiohttp server with its TLS context, client certificates made with openssl (a front-proxy CA as
the cluster's, one foreign CA), httpx as the client. The fleet's ``/metrics`` is a small HTTP server answering a
fixed exposition in the Prometheus text format (the real server's scrape, through the aggregator and the HPA, is
tests/operator/test_real_hpa.py's); the CA comes in as the ConfigMap's data would.
"""

from __future__ import annotations

import json
import pathlib
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import kubernetes_validate
import pytest
from aiohttp import web

from megatron_operator.crd import GROUP
from megatron_operator.metrics_adapter import api
from megatron_operator.metrics_adapter.front_proxy import FrontProxy, server_context
from megatron_operator.metrics_adapter.rules import (DEFAULT_RULES, fleet_unknown, parse_rule, rules_by_name,
                                                     sample_sums)
from megatron_operator.metrics_adapter.server import MetricsAdapter, build_app
from megatron_serve.cli import parse_args
from tests.helpers import free_port

from .helpers import ROOT, load_yaml
from .test_operator_chart import K8S_VERSION

EXPOSITION = """\
# HELP megatron_serve_queue_depth requests queued at the coordinator
# TYPE megatron_serve_queue_depth gauge
megatron_serve_queue_depth 5.0
# TYPE megatron_serve_requests_in_flight gauge
megatron_serve_requests_in_flight 7.0
# TYPE megatron_serve_num_requests_waiting gauge
megatron_serve_num_requests_waiting{engine_group="0",model_name="m"} 2.0
megatron_serve_num_requests_waiting{engine_group="1",model_name="m"} 1.5
"""
#: A server that lost its coordinator: its fleet gauges are zeros that say nothing about the fleet.
UNREACHABLE = """\
# TYPE megatron_serve_coordinator_reachable gauge
megatron_serve_coordinator_reachable 0.0
# TYPE megatron_serve_queue_depth gauge
megatron_serve_queue_depth 0.0
# TYPE megatron_serve_requests_in_flight gauge
megatron_serve_requests_in_flight 0.0
"""
MI = f"megatroninferences.{GROUP}"
BASE = f"/apis/{api.GROUP_VERSION}/namespaces/ns"
MONITORING = ROOT / "manifests" / "examples" / "monitoring"


def test_a_rule_sums_every_label_set_and_counts_an_absent_series_as_zero():
    rules = rules_by_name(DEFAULT_RULES)
    sums = sample_sums(EXPOSITION)
    assert rules["megatron_serve_queue"].value(sums) == 5 + 2 + 1.5
    assert rules["megatron_serve_requests"].value(sums) == 12
    assert rules["megatron_serve_engine_groups_wanted"].value(sums) == 0  # not in the scrape
    assert parse_rule("busy = megatron_serve_queue_depth + megatron_serve_requests_in_flight").value(sums) == 12
    replaced = rules_by_name((*DEFAULT_RULES, parse_rule("megatron_serve_queue=megatron_serve_queue_depth")))
    assert replaced["megatron_serve_queue"].value(sums) == 5
    assert not fleet_unknown(sums) and fleet_unknown(sample_sums(UNREACHABLE))


@pytest.mark.parametrize("text", ["megatron_serve_queue", "x=", "1x=y", "x=a+b c", "=a"])
def test_a_malformed_rule_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="metric rule"):
        parse_rule(text)


def test_quantities_are_whole_or_thousandths():
    assert [api.quantity(v) for v in (0, 12.0, 2.5, 1 / 3)] == ["0", "12", "2500m", "333m"]


@dataclass
class Pki:
    folder: pathlib.Path

    def openssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], cwd=self.folder, check=True, capture_output=True)

    def ca(self, name: str) -> None:
        self.openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", f"{name}.key",
                     "-out", f"{name}.crt", "-subj", f"/CN={name}")

    def leaf(self, name: str, ca: str, extensions: str) -> None:
        (self.folder / f"{name}.ext").write_text(extensions)
        self.openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                     "-subj", f"/CN={name}")
        self.openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
                     "-CAcreateserial", "-days", "1", "-out", f"{name}.crt", "-extfile", f"{name}.ext")

    def path(self, name: str) -> str:
        return str(self.folder / name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A front-proxy CA with its client certificate (and one of another name), a foreign CA with a client of its
    own, and the adapter's serving certificate."""
    made = Pki(tmp_path_factory.mktemp("pki"))
    client = "extendedKeyUsage=clientAuth\n"
    made.ca("front-proxy-ca")
    made.ca("foreign-ca")
    made.leaf("front-proxy-client", "front-proxy-ca", client)
    made.leaf("someone-else", "front-proxy-ca", client)
    made.leaf("foreign-client", "foreign-ca", client)
    made.leaf("adapter", "front-proxy-ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    return made


async def _serve(app: web.Application, context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    return runner, port


@dataclass
class Running:
    url: str
    pki: Pki
    fleet: web.AppRunner

    def client(self, identity: str | None = "front-proxy-client") -> httpx.AsyncClient:
        context = ssl.create_default_context(cafile=self.pki.path("front-proxy-ca.crt"))
        if identity:
            context.load_cert_chain(self.pki.path(f"{identity}.crt"), self.pki.path(f"{identity}.key"))
        return httpx.AsyncClient(base_url=self.url, verify=context)


@pytest.fixture
async def adapter(pki: Pki) -> AsyncIterator[Running]:
    async def metrics(request: web.Request) -> web.Response:
        exposition = {"llama": EXPOSITION, "lost": UNREACHABLE}.get(request.match_info["name"])
        if exposition is None:
            return web.Response(status=404, text="no such fleet")
        return web.Response(text=exposition, content_type="text/plain")

    fleet = web.Application()
    fleet.router.add_get("/{namespace}/{name}/metrics", metrics)
    fleet_runner, fleet_port = await _serve(fleet)
    proxy = FrontProxy.from_configmap({
        "requestheader-client-ca-file": pathlib.Path(pki.path("front-proxy-ca.crt")).read_text(),
        "requestheader-allowed-names": json.dumps(["front-proxy-client"])})
    url = f"http://127.0.0.1:{fleet_port}/{{namespace}}/{{name}}/metrics"
    served = MetricsAdapter(rules_by_name(DEFAULT_RULES), url, proxy)
    runner, port = await _serve(build_app(served), server_context(pki.path("adapter.crt"), pki.path("adapter.key"),
                                                                 proxy))
    try:
        yield Running(f"https://127.0.0.1:{port}", pki, fleet_runner)
    finally:
        await runner.cleanup()
        await fleet_runner.cleanup()


async def test_the_front_proxy_discovers_the_api_and_reads_a_fleets_metric(adapter: Running):
    async with adapter.client() as client:
        group = (await client.get("/apis")).json()
        assert group["groups"][0]["preferredVersion"]["groupVersion"] == "custom.metrics.k8s.io/v1beta2"
        listed = (await client.get(f"/apis/{api.GROUP_VERSION}")).json()
        assert f"{MI}/megatron_serve_requests" in {r["name"] for r in listed["resources"]}
        assert "services/megatron_serve_queue" in {r["name"] for r in listed["resources"]}
        answer = await client.get(f"{BASE}/{MI}/llama/megatron_serve_requests")
        assert answer.status_code == 200, answer.text
        (item,) = answer.json()["items"]
        assert item["describedObject"] == {"kind": "MegatronInference", "namespace": "ns", "name": "llama",
                                           "apiVersion": "serving.megatron.dev/v1alpha1"}
        assert (item["metric"], item["value"]) == ({"name": "megatron_serve_requests"}, "12")
        (item,) = (await client.get(f"{BASE}/services/llama/megatron_serve_queue")).json()["items"]
        assert (item["describedObject"]["kind"], item["value"]) == ("Service", "8500m")


async def test_anyone_but_the_front_proxy_is_refused(adapter: Running):
    path = f"{BASE}/{MI}/llama/megatron_serve_requests"
    async with adapter.client(None) as anonymous:
        refused = await anonymous.get(path)
        assert refused.status_code == 401 and "no client certificate" in refused.json()["message"]
        assert (await anonymous.get("/healthz")).text == "ok"  # a kubelet's probe has no certificate
    async with adapter.client("someone-else") as other:
        refused = await other.get(path)
        assert refused.status_code == 401 and "someone-else" in refused.json()["message"]
    context = ssl.create_default_context(cafile=adapter.pki.path("front-proxy-ca.crt"))
    context.load_cert_chain(adapter.pki.path("foreign-client.crt"), adapter.pki.path("foreign-client.key"))
    async with httpx.AsyncClient(base_url=adapter.url, verify=context) as foreign:
        with pytest.raises(httpx.TransportError):  # TLS fails (TLS 1.3: at the first read): the CA never signed it
            await foreign.get(path)


@pytest.mark.parametrize(("path", "code", "says"), [
    (f"{BASE}/{MI}/llama/megatron_serve_nothing", 404, "serves megatron_serve_queue"),
    (f"{BASE}/deployments.apps/llama/megatron_serve_queue", 404, "serves megatroninferences"),
    (f"{BASE}/{MI}/*/megatron_serve_queue", 404, "name the object"),
    (f"{BASE}/{MI}/llama/megatron_serve_queue?metricLabelSelector=engine_group%3D0", 400, "takes no selector"),
    (f"{BASE}/{MI}/absent/megatron_serve_queue", 503, "/ns/absent/metrics failed"),
    (f"{BASE}/{MI}/lost/megatron_serve_requests", 503, "does not reach its coordinator"),
    (f"/apis/{api.GROUP_VERSION}/{MI}/llama/megatron_serve_queue", 404, "is not served here"),
])
async def test_what_it_cannot_answer_is_a_status_naming_why(adapter: Running, path: str, code: int, says: str):
    async with adapter.client() as client:
        answer = await client.get(path)
    assert answer.status_code == code
    body = answer.json()
    assert (body["kind"], body["code"]) == ("Status", code) and says in body["message"], body


@pytest.mark.parametrize(("flag", "says"), [
    ("--metric=queue", "metric rule 'queue'"),
    ("--metrics-url=http://{name}:{port}/metrics", "only {name} and {namespace}"),
    ("--scrape-timeout=0", "--scrape-timeout 0.0: must be positive"),
])
def test_the_command_refuses_a_bad_flag_naming_it(flag: str, says: str, tmp_path: pathlib.Path):
    done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "metrics-adapter", "--tls-cert-file=x",
                           "--tls-private-key-file=y", flag], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and says in done.stderr, done.stderr


def test_the_in_cluster_example_registers_the_adapter_and_the_hpa_example_reads_what_it_serves():
    """manifests/examples/monitoring/metrics-adapter.yaml and hpa-requests.yaml: valid objects (strict), the
    Deployment's arguments parsed by the command itself, the APIService pointing at the Service, and the HPA asking
    for a metric and a kind the adapter serves."""
    objects = {(o["kind"], o["metadata"]["name"]): o for o in load_yaml(MONITORING / "metrics-adapter.yaml")}
    (hpa,) = load_yaml(MONITORING / "hpa-requests.yaml")
    for obj in [*objects.values(), hpa]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    deployment = objects["Deployment", "megatron-metrics-adapter"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_args(container["args"])
    assert (args.command, args.secure_port) == ("metrics-adapter", container["ports"][0]["containerPort"])
    registered = objects["APIService", "v1beta2.custom.metrics.k8s.io"]["spec"]
    assert (registered["group"], registered["version"]) == (api.API_GROUP, api.API_VERSION)
    service = objects["Service", registered["service"]["name"]]
    assert service["metadata"]["namespace"] == registered["service"]["namespace"]
    assert service["spec"]["ports"][0]["port"] == registered["service"]["port"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    binding = objects["RoleBinding", "megatron-metrics-adapter-auth-reader"]
    assert binding["metadata"]["namespace"] == "kube-system"
    assert binding["subjects"][0]["name"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["object"]["metric"]["name"] in rules_by_name(DEFAULT_RULES)
    described = metric["object"]["describedObject"]
    assert (described["kind"], described["apiVersion"]) == (api.DESCRIBED[MI].kind, api.DESCRIBED[MI].api_version)
    assert described["name"] == hpa["spec"]["scaleTargetRef"]["name"]
