"""A small custom-metrics API server: the fleet's own ``/metrics`` as ``custom.metrics.k8s.io/v1beta2``.

A HorizontalPodAutoscaler reads an ``Object`` metric through the API server's aggregation layer, which proxies to
an APIService's backend. This package is such a backend for clusters without Prometheus and prometheus-adapter: on
each request it scrapes the resource's OpenAI server (one scrape sees the whole fleet) and sums the series a rule
names, for a ``MegatronInference`` or its Service (they share a name). Run it with
``megatron-serve metrics-adapter``; docs/kubernetes/autoscaling.md shows the registration.

- :mod:`.rules`: which custom metric is which sum of Prometheus series;
- :mod:`.api`: the API's discovery documents and ``MetricValueList`` answers;
- :mod:`.front_proxy`: who may ask (the aggregator's client certificate) and the TLS context;
- :mod:`.server`: the HTTPS server that puts them together.
"""
