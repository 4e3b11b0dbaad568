"""Whether a tenant's request may go in now: its limits (429 with ``Retry-After``), the fleet's saturation for
``sheddable`` requests (503 with ``Retry-After``), and the tag its engine requests carry (docs/tenants.md).

A request's tenant is found where it enters: :class:`TenantScope`, a layer in front of the routes, reads the
fairness header, and the key check (:mod:`.api_key`) notes the key's entry, both in one per-request record (a
context variable, so every route that submits sees it without passing it along). :meth:`Tenancy.admit` runs when
the request's engine requests are submitted (``ServerContext.submit``), on every generation route alike:

* a ``sheddable`` request while the fleet is saturated (:class:`Saturation`) gets a 503 before it costs anything:
  at the door, before its body is parsed (:meth:`Tenancy.shed_at_door`), at the pace of :mod:`.refusal_pace`;
* over a limit, a 429 whose ``Retry-After`` is when the limit has room for it again (a request honouring it
  succeeds, unless others of its tenant used the room first); a request that can never fit a limit is a 400. Every
  limit counts engine requests (prompts x ``n``), what the fleet runs: one HTTP request of 160,000 of them counted
  as one against ``max_concurrent`` 64 and stalled the fleet (issue 86);
* otherwise its cost is reserved (a request slot, its prompt tokens and the most it may generate) and its engine
  requests are tagged (``SamplingParams.tenant``). The :class:`Ticket` settles the reservation with what each
  engine request used when it finishes, counts the tenant's series, and frees its slot when the request ends.

Limits are token buckets holding a minute's worth (a tenant may spend a minute's budget at once, then at the rate
it refills); with ``--api-server-count`` N the N processes keep them in one store (:mod:`.tenant_budgets`), so
that they hold for the whole server.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from ..wire.tenancy import MAX_TENANT_NAME
from .errors import APIError
from .http_layer import HTTPLayer
from .refusal_pace import RefusalPace
from .tenant_budgets import LocalBudgets, SharedBudgets, TenantState

if TYPE_CHECKING:
    from ..http_options import Shedding
    from .tenants import KeyEntry, TenancyOptions, Tenant, TenantTable
    from .fleet import FleetMonitor
    from .metrics import ServerMetrics
    from .translate import EngineJob

#: The series name at most this many tenants by name beyond the configured ones.
MAX_LABELLED = 100
OTHER_LABEL = "other"


@dataclass
class RequestTenancy:
    """What one request's way in found: the fairness header's value and the key's entry (None: none yet)."""

    fairness_id: str | None = None
    entry: KeyEntry | None = None


_CURRENT: contextvars.ContextVar[RequestTenancy | None] = contextvars.ContextVar("megatron_serve_tenancy",
                                                                                  default=None)


def note_key(entry: KeyEntry) -> None:
    """The key check's part: the request presented the key of ``entry``."""
    current = _CURRENT.get()
    if current is not None:
        current.entry = entry


class TenantScope(HTTPLayer):
    """ASGI layer: a fresh :class:`RequestTenancy` for each HTTP request, with its fairness header's value."""

    def __init__(self, app: ASGIApp, header: str | None) -> None:
        super().__init__(app)
        self.header = header.lower().encode("latin-1") if header else None

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = None
        if self.header is not None:
            for name, raw in scope["headers"]:
                if name == self.header:
                    value = raw.decode("latin-1")
                    break
        token = _CURRENT.set(RequestTenancy(value))
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)


class Saturation:
    """Whether the fleet is saturated (:class:`~.tenants.Shedding`), from the monitor's last status and this server's
    requests since (a burst between two polls counts). The status's age is the monitor's own
    (:meth:`~.fleet.FleetMonitor.age`, on the clock that stamped it): measured on the budgets' clock, a status polled
    a moment ago read as older than ``stale_after`` whenever the two clocks differed (a test's budget clock against
    the real one shed every sheddable request of a fresh fleet)."""

    def __init__(self, shedding: Shedding, monitor: "FleetMonitor", pending: Callable[[], int]) -> None:
        self.shedding = shedding
        self.monitor = monitor
        self.pending = pending
        self._seen = -1.0  # the status time of the last check
        self._pending_then = 0  # this server's pending count at that status

    def reason(self) -> str | None:
        """Why the fleet counts as saturated now, or None."""
        shedding, monitor = self.shedding, self.monitor
        if monitor.updated != self._seen:
            self._seen, self._pending_then = monitor.updated, self.pending()
        if shedding.stale_after is not None and monitor.age() > shedding.stale_after:
            return f"the fleet's status is older than {shedding.stale_after:g} s"
        engines = monitor.engines
        if not engines:
            return None  # nothing to measure: requests wait for engines, as every class does
        status = monitor.status or {}
        queued = int(status.get("queued") or 0) + max(0, self.pending() - self._pending_then)
        share = queued / len(engines)
        for engine in engines:
            waiting = int(engine.get("waiting") or 0) + share
            total = int(engine.get("kv_blocks_total") or 0)
            used = 1.0 - int(engine.get("kv_blocks_free") or 0) / total if total else 0.0
            if not ((shedding.queue_depth is not None and waiting >= shedding.queue_depth)
                    or (shedding.kv_cache_usage is not None and used >= shedding.kv_cache_usage)):
                return None
        return (f"every engine has at least {shedding.queue_depth:g} requests waiting or {shedding.kv_cache_usage:g} "
                f"of its KV cache in use")


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted request's reservation: counted per engine request (:meth:`finished`), settled and freed once
    (:meth:`close`: one change to the budgets per request, which a store shared between processes pays for).
    ``limited``: whether its tenant has limits (its reservation is in the tenancy's budgets); ``slots``: its engine
    requests, what it holds of its tenant's ``max_concurrent``."""

    tenancy: "Tenancy"
    tenant: Tenant
    limited: bool
    label: str
    slots: int
    closed: bool = False
    unused: int = 0  # reserved tokens the finished engine requests did not generate

    def finished(self, request: Any) -> None:
        """One engine request finished (a ``DynamicInferenceRequest``): its unused tokens noted, its series count."""
        self.unused += max(0, request.sampling_params.num_tokens_to_generate - len(request.generated_tokens or ()))
        self.tenancy.metrics.observe_tenant_request((self.label, self.tenant.priority_class), request)

    def close(self) -> None:
        """The request ended: its slot and the tokens it did not use go back."""
        if not self.closed:
            self.closed = True
            if self.limited:
                now = self.tenancy.clock()
                with self.tenancy.budgets.hold(self.tenant, now) as state:
                    state.running -= self.slots
                    if state.tokens is not None and self.unused:
                        state.tokens.give(self.unused, now)


class Tenancy:
    """The tenants of one server and their budgets (module docstring)."""

    def __init__(self, table: TenantTable, options: TenancyOptions, monitor: "FleetMonitor", metrics: "ServerMetrics",
                 pending: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.header = options.header_name  # the fairness header (None: not read)
        self.metrics = metrics
        metrics.enable_tenants()
        self.clock = clock
        self.saturation = Saturation(options.shedding, monitor, pending)
        self.retry_after = options.shedding.retry_after
        self.pace = RefusalPace()  # how fast a tenant's shed requests are answered
        # the tenants' budgets: this process's own, or shared by the processes of --api-server-count
        self.budgets = LocalBudgets() if metrics.shared_dir is None else SharedBudgets(metrics.shared_dir)
        self.labels: set[str] = set(table.tenants)

    def tenant(self) -> Tenant:
        """The current request's tenant (400 for a fairness id that cannot name one)."""
        current = _CURRENT.get()
        if current is None:
            return self.table.default
        fairness_id = current.fairness_id
        if fairness_id is not None and (not fairness_id or len(fairness_id) > MAX_TENANT_NAME
                                        or not fairness_id.isprintable()):
            raise APIError(400, f"the fairness id header must hold 1 to {MAX_TENANT_NAME} printable characters",
                           code="invalid_tenant")
        return self.table.tenant(current.entry, fairness_id)

    def label(self, tenant: Tenant) -> str:
        """The tenant's name in the series (the first :data:`MAX_LABELLED` beyond the configured ones, then other)."""
        name = tenant.name
        if name in self.labels:
            return name
        if len(self.labels) < len(self.table.tenants) + MAX_LABELLED:
            self.labels.add(name)
            return name
        return OTHER_LABEL

    def admit(self, jobs: list["EngineJob"]) -> Ticket:
        """Admit the current request's ``jobs`` (its engine requests) or raise its 429, 503 or 400; tags them."""
        tenant = self.tenant()
        label = self.label(tenant)
        labels = (label, tenant.priority_class)
        if tenant.priority_class == "sheddable":
            reason = self.saturation.reason()
            if reason is not None:  # saturated since the request passed the door (:meth:`shed_at_door`)
                raise self._shed(labels, reason)
        limited = tenant.limits.any
        if limited:
            with self.budgets.hold(tenant, self.clock()) as state:
                self._reserve(tenant, state, labels, jobs)
        tag = tenant.tag
        for job in jobs:
            job.params = _tagged(job.params, tag)
        return Ticket(self, tenant, limited, label, len(jobs))

    async def shed_at_door(self) -> None:
        """Refuse the current request, before its body is parsed, when it is ``sheddable`` and the fleet saturated:
        its 503, answered once its tenant's refusal pace allows (:mod:`.refusal_pace`), so that a flood that sends
        its refusals straight back cannot take the event loop that other tenants' tokens pass through."""
        tenant = self.tenant()
        if tenant.priority_class != "sheddable":
            return
        reason = self.saturation.reason()
        if reason is None:
            return
        hold = self.pace.hold(tenant.name)
        if hold:
            await asyncio.sleep(hold)
        raise self._shed((self.label(tenant), tenant.priority_class), reason)

    def _shed(self, labels: tuple[str, str], reason: str) -> APIError:
        self.metrics.count_tenant_refusal(labels, "saturated")
        return APIError(503, f"the fleet is saturated ({reason}): sheddable requests are refused until it has room",
                        code="fleet_saturated", headers={"Retry-After": str(self.retry_after)})

    def _reserve(self, tenant: Tenant, state: TenantState, labels: tuple[str, str], jobs: list["EngineJob"]) -> None:
        """Take the request's cost from ``state``, or raise the refusal naming the limit it is over."""
        limits, now = tenant.limits, self.clock()
        count = len(jobs)  # every limit counts engine requests (prompts x n), what the fleet runs
        tokens = sum(len(job.prompt.tokens) + job.params.num_tokens_to_generate for job in jobs)
        for limit, asked, most in (("max_concurrent", count, limits.max_concurrent),
                                   ("requests_per_minute", count, limits.requests_per_minute),
                                   ("tokens_per_minute", tokens, limits.tokens_per_minute)):
            if most is not None and asked > most:
                what = "tokens (prompts and max_tokens)" if limit == "tokens_per_minute" else "engine requests (prompts x n)"
                raise APIError(400, f"this request asks for {asked} {what}, more than tenant {tenant.name!r}'s "
                                    f"{limit} of {most}: send fewer prompts, a smaller n or max_tokens",
                               code="over_tenant_limit")
        if limits.max_concurrent is not None and state.running + count > limits.max_concurrent:
            self.metrics.count_tenant_refusal(labels, "max_concurrent")
            raise _limited(tenant, "max_concurrent", f"{state.running} engine requests in progress", 1)
        waits = {"requests_per_minute": state.requests.wait(count, now) if state.requests is not None else 0.0,
                 "tokens_per_minute": state.tokens.wait(tokens, now) if state.tokens is not None else 0.0}
        limit, wait = max(waits.items(), key=lambda item: item[1])
        if wait > 0:
            self.metrics.count_tenant_refusal(labels, limit)
            raise _limited(tenant, limit, f"{getattr(limits, limit)} a minute", math.ceil(wait))
        if state.requests is not None:
            state.requests.take(count)
        if state.tokens is not None:
            state.tokens.take(tokens)
        state.running += count


def _limited(tenant: Tenant, limit: str, figure: str, retry_after: int) -> APIError:
    return APIError(429, f"tenant {tenant.name!r} is over its {limit} ({figure}); retry in {retry_after} s",
                    param=None, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def _tagged(params: Any, tag: Any) -> Any:
    return msgspec.structs.replace(params, tenant=tag)
