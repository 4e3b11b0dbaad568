"""Tenants and priority classes as a request carries them between processes (``SamplingParams.tenant``).

A request of a configured tenant carries a :class:`TenantTag` (declared with the sampling parameters, on which it travels): whose it is (the tenant's name), its class, and the
tenant's weight. The HTTP server sets it (``server.tenants``: from the API key, or the fairness id a gateway sets);
the coordinator's queue (``coordinator.fair_queue``) and the engines' scheduler (``engine.tenancy``) read it. A
request without a tag is the anonymous tenant's, of the ``standard`` class: with no tenants configured nothing
carries a tag and both queues behave as they did before tenants existed.

The classes are strict bands, as the Gateway API Inference Extension's ``InferenceObjective`` priorities and the
SGLang Model Gateway's classes are: a waiting request of a better band goes before every request of a worse one,
and takes the slot or KV blocks of a running one of a worse band when they run out. ``sheddable`` requests are
also the ones the server refuses (503 with ``Retry-After``) when the fleet is saturated. Within a band, tenants
share by tokens in proportion to their weights (a virtual token counter: see ``coordinator.fair_queue``), and
vLLM's ``priority`` orders one tenant's own requests.
"""

from __future__ import annotations

from .sampling_params import TENANT_CLASSES, TenantTag

#: The classes, best band first: a request's band is its class's index here.
CLASSES = TENANT_CLASSES
BANDS = {name: band for band, name in enumerate(CLASSES)}
DEFAULT_CLASS = "standard"
STANDARD_BAND = BANDS[DEFAULT_CLASS]
WORST_BAND = len(CLASSES) - 1
#: A tenant's name as it travels (a fairness id a gateway sets is refused beyond this).
MAX_TENANT_NAME = 128

__all__ = ["BANDS", "CLASSES", "DEFAULT_CLASS", "MAX_TENANT_NAME", "STANDARD_BAND", "TenantTag", "WORST_BAND",
           "band_of"]


def band_of(tag: TenantTag | None) -> int:
    """The band of a request with ``tag`` (None: an untagged request, ``standard``)."""
    return STANDARD_BAND if tag is None else BANDS[tag.priority_class]
