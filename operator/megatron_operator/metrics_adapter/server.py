"""The adapter's HTTPS server: discovery, and each metric read from the fleet's ``/metrics`` when asked.

Nothing is cached: the HPA controller asks once per sync period (15 s by default), and one scrape of the resource's
OpenAI server costs less than keeping a poller per resource. A scrape that fails, or whose server does not reach its
coordinator, answers 503, which the HPA shows as its ``ScalingActive=False`` condition (``FailedGetObjectMetric``)
and scales nothing on.
"""

from __future__ import annotations

import datetime
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from aiohttp import web

from . import api
from .front_proxy import FrontProxy
from .rules import REACHABLE, MetricRule, fleet_unknown, sample_sums

log = logging.getLogger("megatron_operator.metrics_adapter")

#: What a kubelet's probe may ask without the front proxy's certificate.
HEALTH_PATHS = frozenset({"/healthz", "/livez", "/readyz"})
_METRIC_PATH = (f"/apis/{api.API_GROUP}/{api.API_VERSION}/namespaces/{{namespace}}/{{resource}}/{{name}}/"
                "{metric}")


class MetricsAdapter:
    """The metrics it serves (``rules``) and where a resource's metrics come from: ``metrics_url``, a template
    with ``{name}`` and ``{namespace}`` (the resource's), e.g. ``http://{name}.{namespace}.svc:8000/metrics``."""

    def __init__(self, rules: dict[str, MetricRule], metrics_url: str, proxy: FrontProxy,
                 scrape_timeout: float = 5.0):
        self.rules, self.metrics_url, self.proxy = rules, metrics_url, proxy
        self.http = httpx.AsyncClient(timeout=scrape_timeout)

    async def scrape(self, url: str) -> str:
        response = await self.http.get(url)
        response.raise_for_status()
        return response.text

    async def metric(self, request: web.Request) -> web.Response:
        info = request.match_info
        namespace, resource, name, metric = info["namespace"], info["resource"], info["name"], info["metric"]
        kind = api.DESCRIBED.get(resource)
        if kind is None:
            return _status(404, f"no metrics for {resource!r}: this adapter serves {', '.join(api.DESCRIBED)}")
        rule = self.rules.get(metric)
        if rule is None:
            return _status(404, f"no metric {metric!r}: this adapter serves {', '.join(self.rules)}")
        if name == "*":
            return _status(404, "metrics of every object at once (name *) are not served: name the object")
        if request.query.get("metricLabelSelector"):
            return _status(400, f"metricLabelSelector {request.query['metricLabelSelector']!r}: {metric} is a sum "
                                "over the fleet and takes no selector")
        url = self.metrics_url.format(name=name, namespace=namespace)
        try:
            sums = sample_sums(await self.scrape(url))
        except (httpx.HTTPError, ValueError) as exc:
            return _status(503, f"{metric} of {namespace}/{name}: scraping {url} failed: {type(exc).__name__}: {exc}")
        if fleet_unknown(sums):
            return _status(503, f"{metric} of {namespace}/{name}: the server at {url} does not reach its coordinator "
                                f"({REACHABLE} 0): the fleet's figures are not known")
        value = rule.value(sums)
        log.info("%s/%s %s = %g", namespace, name, metric, value)
        now = datetime.datetime.now(datetime.timezone.utc)
        return web.json_response(api.metric_value_list(kind, namespace, name, metric, value, now))

    async def close(self) -> None:
        await self.http.aclose()


def _status(code: int, message: str) -> web.Response:
    return web.json_response(api.status(code, message), status=code)


def build_app(adapter: MetricsAdapter) -> web.Application:
    """The routes; every one but the health checks for the front proxy alone (see :mod:`.front_proxy`)."""

    @web.middleware
    async def front_proxy_only(request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path not in HEALTH_PATHS:
            transport = request.transport
            refusal = adapter.proxy.refusal(transport.get_extra_info("peercert") if transport else None)
            if refusal:
                return _status(401, refusal)
        return await handler(request)

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    def document(body: Callable[[], dict[str, Any]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_: web.Request) -> web.Response:
            return web.json_response(body())
        return handler

    async def not_found(request: web.Request) -> web.Response:
        return _status(404, f"{request.path} is not served here (custom.metrics.k8s.io/v1beta2 of "
                            f"{', '.join(api.DESCRIBED)})")

    app = web.Application(middlewares=[front_proxy_only])
    app.router.add_get("/apis", document(api.group_list))
    app.router.add_get(f"/apis/{api.API_GROUP}", document(api.group))
    app.router.add_get(f"/apis/{api.GROUP_VERSION}", document(lambda: api.resource_list(adapter.rules)))
    app.router.add_get(_METRIC_PATH, adapter.metric)
    for path in HEALTH_PATHS:
        app.router.add_get(path, ok)
    app.router.add_route("*", "/{tail:.*}", not_found)
    async def close(_: web.Application) -> None:
        await adapter.close()

    app.on_cleanup.append(close)
    return app


def serve(adapter: MetricsAdapter, host: str, port: int, context: ssl.SSLContext) -> None:
    """Serve until stopped (SIGTERM or SIGINT)."""
    log.info("serving %s for %s on https://%s:%d, reading %s", ", ".join(adapter.rules), ", ".join(api.DESCRIBED),
             host, port, adapter.metrics_url)
    web.run_app(build_app(adapter), host=host, port=port, ssl_context=context, print=None,
                access_log_format='%a %{X-Remote-User}i "%r" %s %Tfs')
