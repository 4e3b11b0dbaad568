"""``megatron-serve metrics-adapter``: serve the fleets' own metrics as ``custom.metrics.k8s.io/v1beta2`` for a
HorizontalPodAutoscaler, behind an APIService (docs/kubernetes/autoscaling.md)."""

from __future__ import annotations

import argparse

DEFAULT_METRICS_URL = "http://{name}.{namespace}.svc:8000/metrics"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..metrics_adapter.rules import DEFAULT_RULES

    defaults = ", ".join(f"{r.name}={'+'.join(r.series)}" for r in DEFAULT_RULES)
    parser.add_argument("--secure-port", type=int, default=6443, metavar="PORT",
                        help="HTTPS port (kube-apiserver's flag name)")
    parser.add_argument("--bind-address", default="0.0.0.0", metavar="ADDRESS", help="address to listen on")
    parser.add_argument("--tls-cert-file", required=True, metavar="PATH",
                        help="serving certificate (PEM); the APIService verifies it with its caBundle, or not at all "
                             "with insecureSkipTLSVerify")
    parser.add_argument("--tls-private-key-file", required=True, metavar="PATH", help="its private key (PEM)")
    parser.add_argument("--metrics-url", default=DEFAULT_METRICS_URL, metavar="URL",
                        help="where a resource's metrics are scraped: {name} and {namespace} are the resource's "
                             "(its Service has its name; use the port of spec.server.port)")
    parser.add_argument("--metric", action="append", metavar="NAME=SERIES[+SERIES...]",
                        help="serve NAME as the sum of these series over every label set (repeatable; replaces a "
                             f"default of the same name). Served without it: {defaults}")
    parser.add_argument("--scrape-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="seconds one scrape may take")


def run(args: argparse.Namespace) -> int:
    import logging

    import kubernetes

    from ..metrics_adapter.front_proxy import FrontProxy, server_context
    from ..metrics_adapter.rules import DEFAULT_RULES, parse_rule, rules_by_name
    from ..metrics_adapter.server import MetricsAdapter, serve

    rules = rules_by_name((*DEFAULT_RULES, *(parse_rule(text) for text in args.metric or ())))
    try:
        args.metrics_url.format(name="n", namespace="ns")
    except (KeyError, IndexError) as exc:
        raise ValueError(f"--metrics-url {args.metrics_url!r}: only {{name}} and {{namespace}} may be used "
                         f"({exc} is not one)") from None
    if args.scrape_timeout <= 0:
        raise ValueError(f"--scrape-timeout {args.scrape_timeout}: must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kubernetes.config.load_config()  # in a pod its ServiceAccount, else $KUBECONFIG
    with kubernetes.client.ApiClient() as client:
        proxy = FrontProxy.from_cluster(kubernetes.client.CoreV1Api(client))
    context = server_context(args.tls_cert_file, args.tls_private_key_file, proxy)
    serve(MetricsAdapter(rules, args.metrics_url, proxy, args.scrape_timeout), args.bind_address, args.secure_port,
          context)
    return 0
